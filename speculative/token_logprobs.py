"""The logprobs a request asked for, as they travel from the verify step to the front ends: plain lists,
nothing of torch, so the front ends' processes can read them without importing it."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # top alternatives a request can ask for per token (OpenAI's top_logprobs limit)


@dataclass
class TokenLogprobs:
    """Logprobs of a request's emitted tokens in one step (SeqResult.logprobs), one entry per token."""

    token_logprobs: list[float]
    top_token_ids: list[list[int]]  # the n most likely tokens of each position, most likely first
    top_logprobs: list[list[float]]

    def extend(self, other: TokenLogprobs) -> None:
        """Append another step's entries."""
        self.token_logprobs += other.token_logprobs
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs

    def head(self, n: int) -> TokenLogprobs:
        """The first `n` entries (tokens cut by a stop or max_tokens drop theirs)."""
        return TokenLogprobs(self.token_logprobs[:n], self.top_token_ids[:n], self.top_logprobs[:n])
