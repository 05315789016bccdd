"""Messages of the OpenAI-compatible HTTP API: pydantic request models and the response, chunk and error bodies.

Fields this server does not know are ignored (SDKs add new ones); fields it knows but does not implement are
refused by name when set to anything but their neutral value. Extensions beyond OpenAI's fields, named as vLLM
names them: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
`ignore_eos`,
`return_token_ids` (each choice, and each streamed chunk, carries its token ids) and, in the response's `usage`,
`speculative`: the request's drafted and accepted draft tokens and acceptance length.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mtpserve.cluster.engine.errors import InvalidRequestError, invalid_field
from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.cluster.service.choices import MAX_CHOICES
from mtpserve.cluster.service.stop_strings import stop_strings_problem
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import MAX_LOGPROBS

INT32_MAX = 2**31 - 1
# Known fields this server does not implement: refused unless absent or set to their neutral value.
UNSUPPORTED = (
    "functions",
    "suffix",
)
NEUTRAL_VALUES: tuple[Any, ...] = (None, False, 0, "", [], {})
# vLLM's extensions this server does not implement, with their neutral values
UNSUPPORTED_EXTENSIONS: dict[str, tuple[Any, ...]] = {}
RULES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p")  # passed on as set
ONE_CHOICE = ("best_of",)  # no server-side choosing among candidates


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)  # "10" is no integer, "yes" no bool


def encodable(value: str) -> str:
    """`value` when it is valid Unicode text (no lone surrogate, which JSON's \\ud800 escapes can carry)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


class StreamOptions(_Body):
    """`stream_options`: with include_usage, a last chunk (no choices) carries the usage."""

    include_usage: bool = False


class CalledFunction(_Body):
    """The function of an earlier tool call: its name and arguments (JSON text, as OpenAI sends them)."""

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallMessage(_Body):
    """A tool call in an earlier assistant turn."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments as an object when they are JSON."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                args = json.loads(args) if args else {}
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(_Body):
    """One turn of a conversation; `content` is a string or a list of text parts, joined here."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        if value is None:
            return ""  # an assistant turn that only calls tools
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: str) -> str:
        return encodable(value)

    def turn(self) -> dict[str, Any]:
        """The turn for the chat template ("developer" is the system turn of newer OpenAI models); tool calls
        carry their arguments as objects, as templates expect."""
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            turn["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


class FunctionDef(_Body):
    """A tool's function: name, description and a JSON schema of its parameters."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Body):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDef


class NamedTool(_Body):
    """`tool_choice` naming one function."""

    type: Literal["function"]
    function: dict[str, str]


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`: a named schema (`strict` is accepted; the schema is always enforced)."""

    name: str = "schema"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        """What the reply must match; None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return GrammarSpec("json_schema", json.dumps(self.json_schema.schema_))


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema, a regex, a list of choices or an EBNF
    grammar."""

    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> GrammarSpec:
        """The grammar it asks for."""
        options = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        given = [name for name, value in options.items() if value is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        if self.json_ is not None:
            return GrammarSpec("json_schema", json.dumps(self.json_), "structured_outputs.json")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            alternatives = "|".join(re.escape(c) for c in self.choice)
            return GrammarSpec("regex", f"({alternatives})", "structured_outputs.choice")
        return GrammarSpec("grammar", self.grammar or "", "structured_outputs.grammar")


class _Generation(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, le=INT32_MAX)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, le=INT32_MAX)
    min_p: float | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("structured_outputs")
    @classmethod
    def _one_kind(cls, value: StructuredOutputs | None) -> StructuredOutputs | None:
        if value is not None:
            value.spec()
        return value

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None:
            value.grammar()
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _no_null(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        problem = stop_strings_problem(items) if isinstance(items, list) else None
        if problem is not None:
            raise ValueError(problem)
        return items

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field, value) of the answer's token limit the caller set (value None when unset)."""
        return "max_tokens", self.max_tokens

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """The engine's SamplingParams fields (unset ones left to its defaults)."""
        data: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed", *RULES):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if self.stop_token_ids:
            data["stop_token_ids"] = self.stop_token_ids
        if self.logit_bias:
            data["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.logprobs_asked() is not None:
            data["logprobs"] = self.logprobs_asked()
        grammar = self.structured_outputs.spec() if self.structured_outputs else None
        if self.response_format is not None and self.response_format.grammar() is not None:
            if grammar is not None:
                raise InvalidRequestError("structured_outputs", "give it or response_format, not both")
            grammar = self.response_format.grammar()
        if grammar is not None:
            data["grammar"] = grammar
        return data

    def logprobs_asked(self) -> int | None:
        """Alternatives per token the caller asked logprobs with (0: the tokens' own); None: no logprobs."""
        return None


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, le=INT32_MAX)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None  # accepted; a reply may hold several calls either way

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(value, NamedTool):
            name = value.function.get("name")
            if name not in {t.function.name for t in tools}:
                raise ValueError(f"names function {name!r}, which is not among tools")
        elif value == "required" and not tools:
            raise ValueError("'required' needs tools")
        return value

    def functions(self) -> list[dict[str, Any]]:
        """The tools a reply may call under tool_choice: their function definitions."""
        if not self.tools or self.tool_choice == "none":
            return []
        defs = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedTool):
            return [d for d in defs if d["name"] == self.tool_choice.function["name"]]
        return defs

    @property
    def forces_call(self) -> bool:
        """Whether the reply must be a tool call (tool_choice "required" or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedTool)

    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return value

    def logprobs_asked(self) -> int | None:
        """top_logprobs (0 when unset) if logprobs is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """max_completion_tokens (OpenAI's newer name) if set, else max_tokens."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Generation):
    """POST /v1/completions: one prompt, as text or token ids (a list of one of them is accepted too)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("with logprobs would need the prompt's logprobs, which this server does not compute")
        return value

    def logprobs_asked(self) -> int | None:
        """`logprobs`: alternatives per token (0: the tokens' own); None: no logprobs."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(value)}")
            value = value[0]
        if isinstance(value, str):
            return encodable(value)
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        raise ValueError("must be a string or a list of token ids")


def parse(model: type[_Generation], body: Any) -> Any:
    """A validated request of `model` from a decoded JSON body; InvalidRequestError names the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    for name in UNSUPPORTED:
        if not any(body.get(name) is v or body.get(name) == v for v in NEUTRAL_VALUES):
            raise InvalidRequestError(name, "is not supported by this server")
    for name, neutral in UNSUPPORTED_EXTENSIONS.items():
        value = body.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise InvalidRequestError(name, "is not supported by this server")
    for name in ONE_CHOICE:
        if body.get(name) not in (None, 1):
            raise InvalidRequestError(name, f"only 1 is supported, got {body.get(name)!r}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_field(exc) from None


# ---- response bodies ---------------------------------------------------------------------------------
def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_body(prompt_tokens: int, completion_tokens: int, stats: SpecStats | None) -> dict[str, Any]:
    """`usage`, with the request's speculative decoding figures under the extra key `speculative`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculative": (stats or SpecStats()).to_dict(),
    }


def choice_body(
    chat: bool, text: str, finish_reason: str | None, token_ids: list[int] | None, delta: bool, first: bool = False
) -> dict[str, Any]:
    """One choice (index 0) of a response (`delta` False) or of a streamed chunk."""
    choice: dict[str, Any] = {"index": 0}
    if not chat:
        choice["text"] = text
    elif delta:
        choice["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    else:
        choice["message"] = {"role": "assistant", "content": text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]], chunk: bool
) -> dict[str, Any]:
    """The envelope of a response or a streamed chunk."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
