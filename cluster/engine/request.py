"""Requests, their sampling parameters and their lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mtpserve.cluster.engine.errors import InvalidRequestError, invalid_field
from mtpserve.speculative.stats import SpecStats

MIN_TEMPERATURE = 1e-5  # lower temperatures decode greedily (vLLM's rule too)


class SamplingParams(BaseModel):
    """Per-request decoding settings; invalid values fail validation naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 (or below 1e-5) means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, value: float) -> float:
        return 0.0 if value < MIN_TEMPERATURE else value  # logits / 1e-40 overflow to inf, and softmax to NaN

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below MIN_TEMPERATURE)."""
        return self.temperature == 0.0


def sampling_params(data: dict[str, Any], prefix: str = "") -> SamplingParams:
    """Validated SamplingParams from plain values (absent ones take the defaults); InvalidRequestError names
    `prefix` + the field (the gRPC servicer passes "sampling.", the HTTP API none)."""
    try:
        return SamplingParams.model_validate(data)
    except ValidationError as exc:
        raise invalid_field(exc, prefix) from None


def check_output_room(prompt_tokens: int, max_tokens: int, max_model_len: int, field: str = "max_tokens") -> None:
    """InvalidRequestError naming `field` when the prompt and the tokens asked for exceed the model's maximum
    length (the engine would otherwise stop the request there, short of what was asked)."""
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            field, f"{max_tokens} + {prompt_tokens} prompt tokens exceed the model's maximum length {max_model_len}"
        )


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
