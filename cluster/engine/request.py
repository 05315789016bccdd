"""Requests, their sampling parameters and their lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mtpserve.cluster.engine.errors import InvalidRequestError, invalid_field
from mtpserve.cluster.engine.grammar import GrammarSpec, RequestGrammar
from mtpserve.speculative.logits_processing import MAX_LOGPROBS, LogitsProcessing
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
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once from each output token's logit")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtracted from each token's logit once per time it occurs in the output"
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="divides positive (multiplies negative) logits of prompt and output tokens"
    )
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> added to its logit")
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens cannot end the output before this many")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the most likely's probability")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="report each output token's logprob and this many alternatives"
    )
    grammar: GrammarSpec | None = Field(None, description="what the output must match (structured outputs)")

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, value: float) -> float:
        return 0.0 if value < MIN_TEMPERATURE else value  # logits / 1e-40 overflow to inf, and softmax to NaN

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {token}: ids must be >= 0 and biases in [-100, 100], got {bias}")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_tokens")
        if most is not None and value > most:
            raise ValueError(f"{value} exceeds max_tokens ({most})")
        return value

    @property
    def row_fields(self) -> dict[str, Any]:
        """The sampling fields of the request's rows in a step (`SeqPlan`)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below MIN_TEMPERATURE)."""
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the request has logit rules or asks for logprobs (its steps then run eagerly)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.min_p
            or self.logprobs is not None
            or self.grammar is not None
        )


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
