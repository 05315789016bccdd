"""What one engine step produced for one request, as the front ends receive it."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats = field(default_factory=SpecStats)
    timings: tuple[float, float, float] | None = None  # when it finished: queued, prefill, decode seconds
    logprobs: TokenLogprobs | None = None  # of new_token_ids, when the request asked for them
