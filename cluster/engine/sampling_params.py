"""A request's sampling parameters, validated where it arrives (the front ends) and read by the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mtpserve.cluster.engine.errors import InvalidRequestError, invalid_field
from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.speculative.token_logprobs import MAX_LOGPROBS

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
