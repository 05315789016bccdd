"""Requests and their lifecycle state in the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from mtpserve.cluster.engine.grammar import RequestGrammar
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.speculative.logits_processing import LogitsProcessing
from mtpserve.speculative.stats import SpecStats


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler finds requests in its lists by object, not by value
class Request:
    """A generation request and its scheduler state."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # context cursor: tokens whose KV is in the cache
    in_context: bool = True  # computing context (prompt, or prompt+output after preemption)
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the first full blocks
    num_keyed_blocks: int = 0  # leading block_ids that are findable by their keys
    draft_token_ids: list[int] = field(default_factory=list)  # proposals to verify next step
    draft_probs: Any = None  # [K, V] draft distribution when sampling, else None
    draft_parents: list[int] | None = None  # a draft tree's parents (SeqPlan.draft_parents); None: a chain
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    stop_set: frozenset[int] = frozenset()  # tokens that end it: stop ids, and EOS unless ignored (set when queued)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted to a step
    first_token_time: float | None = None
    processed: bool = field(init=False)  # has logit rules or asks for logprobs (params.processed, read per step)
    grammar: RequestGrammar | None = None  # its structured output's matcher, at the end of its output

    def __post_init__(self) -> None:
        self.processed = self.params.processed

    def timings(self) -> tuple[float, float, float] | None:
        """(queued, prefill, decode) seconds of a request that ends now: arrival to its first step, to its first
        token, to now; None when it produced no token."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        now = time.monotonic()
        return (
            self.scheduled_time - self.arrival_time,
            self.first_token_time - self.scheduled_time,
            now - self.first_token_time,
        )

    def processing(self, branches: list[list[int]]) -> LogitsProcessing | None:
        """The request's logit rules and logprobs for a step that follows its output so far, row r after the
        drafts branches[r] (`row_branches`); None without any."""
        p = self.params
        if not self.processed:
            return None
        return LogitsProcessing(
            output_token_ids=list(self.output_token_ids),
            prompt_token_ids=self.prompt_token_ids if p.repetition_penalty != 1.0 else [],
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias,
            min_tokens=p.min_tokens,
            stop_token_ids=sorted(self.stop_set),
            min_p=p.min_p,
            logprobs=-1 if p.logprobs is None else p.logprobs,
            allowed=None if self.grammar is None else self.grammar.row_masks(branches),
        )

    def append_until_stop(self, tokens: list[int], max_model_len: int) -> tuple[list[int], str | None]:
        """Append tokens one by one up to the first stop condition: (the tokens appended, the reason)."""
        emitted: list[int] = []
        for tok in tokens:
            self.output_token_ids.append(tok)
            emitted.append(tok)
            if tok in self.stop_set:
                return emitted, "stop"
            if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
                return emitted, "length"
        return emitted, None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """all_token_ids[start:], without copying the part before `start`."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - p) :]

    @property
    def num_tokens(self) -> int:
        """Length of the known sequence."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED
