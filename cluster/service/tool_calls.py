"""Tool calls in a model's own format: found in its text (whole or streamed), and forced by a grammar when the
request requires one (`tool_choice` "required" or a named function).

Two formats, one small class each, picked from the model's architecture:
- Hermes, as Qwen2/2.5/3 chat templates write it: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number of calls, text around them is the message's content.
- Llama 3.x JSON calls: the whole reply is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` when the
  template writes one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from mtpserve.cluster.engine.errors import InvalidRequestError
from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.cluster.engine.sampling_params import SamplingParams


@dataclass
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry (with `index` for a streamed delta)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


class ToolFormat(Protocol):
    """How one model family writes tool calls."""

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply; text that only looks like a call stays content."""
        ...

    def opening(self) -> str:
        """Text that starts a call: a stream holds back what could begin it."""
        ...

    def closing(self) -> str | None:
        """Text that ends a call, or None when a call runs to the end of the reply."""
        ...

    def forced(self, tools: list[dict[str, Any]]) -> GrammarSpec:
        """A grammar whose every text is one call of one of `tools` (OpenAI function definitions)."""
        ...


def _call_schema(tools: list[dict[str, Any]], arguments_key: str) -> str:
    """A JSON schema of {"name": one tool's name, arguments_key: that tool's parameters}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, arguments_key: t.get("parameters") or {"type": "object"}},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def _parse(blob: str, arguments_key: str) -> ToolCall | None:
    """A call from its JSON, or None when it is not one."""
    try:
        data = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get(arguments_key, data.get("arguments", {}))
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args))


class HermesFormat:
    """`<tool_call>{json}</tool_call>` blocks (Qwen2, Qwen2.5, Qwen3)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply."""
        content, calls, rest = [], [], text
        while (start := rest.find(self.OPEN)) >= 0:
            end = rest.find(self.CLOSE, start)
            if end < 0:
                break
            call = _parse(rest[start + len(self.OPEN) : end].strip(), "arguments")
            if call is None:
                break
            content.append(rest[:start])
            calls.append(call)
            rest = rest[end + len(self.CLOSE) :]
        content.append(rest)
        return "".join(content).strip() if calls else text, calls

    def opening(self) -> str:
        """`<tool_call>`."""
        return self.OPEN

    def closing(self) -> str | None:
        """`</tool_call>`."""
        return self.CLOSE

    def forced(self, tools: list[dict[str, Any]]) -> GrammarSpec:
        """One `<tool_call>` block of one of the tools."""
        return GrammarSpec(
            "json_schema", _call_schema(tools, "arguments"), "tool_choice", self.OPEN + "\n", suffix="\n" + self.CLOSE
        )


class Llama3Format:
    """A reply that is one JSON call, `{"name": ..., "parameters": ...}` (Llama 3.1-3.3)."""

    TAG = "<|python_tag|>"

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls): a call when the whole reply parses as one."""
        body = text.strip().removeprefix(self.TAG).strip()
        call = _parse(body, "parameters") if body.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])

    def opening(self) -> str:
        """`{` at the start of the reply."""
        return "{"

    def closing(self) -> str | None:
        """None: the call runs to the end of the reply."""
        return None

    def forced(self, tools: list[dict[str, Any]]) -> GrammarSpec:
        """One JSON call of one of the tools."""
        return GrammarSpec("json_schema", _call_schema(tools, "parameters"), "tool_choice")


def offer_tools(tokenizer: Any, architecture: str, functions: list[dict[str, Any]], forced: bool) -> ToolUse | None:
    """How a reply may call `functions` (None when none is offered); InvalidRequestError naming `tools` when the
    chat template does not render tools."""
    if not functions:
        return None
    if "tools" not in str(tokenizer.chat_template):
        raise InvalidRequestError("tools", "this model's chat template does not render tools")
    fmt = tool_format(architecture)
    return ToolUse(fmt, fmt.forced(functions) if forced else None)


def _open_prefix(text: str, opening: str) -> int:
    """Length of the longest end of `text` that begins `opening` (held back: the next delta may complete it)."""
    return next((k for k in range(min(len(text), len(opening) - 1), 0, -1) if opening.startswith(text[-k:])), 0)


@dataclass
class ToolUse:
    """A chat request's tools as its reply sees them: the model's call format, and the grammar that forces a call
    (tool_choice "required" or a named function; None lets the model choose)."""

    fmt: ToolFormat
    forced: GrammarSpec | None = None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the forced call's grammar (unchanged when the model chooses); InvalidRequestError when
        the request asks for another format as well."""
        if self.forced is None:
            return params
        if params.grammar is not None:
            raise InvalidRequestError("tool_choice", "a required tool call cannot be combined with another format")
        return params.model_copy(update={"grammar": self.forced})


def tool_format(architecture: str) -> ToolFormat:
    """The call format of a model family (Hermes for Qwen and anything unknown, JSON calls for Llama)."""
    return Llama3Format() if architecture.startswith("Llama") else HermesFormat()


class StreamedCalls:
    """Splits a streamed reply into content deltas and whole calls as they complete; text that may begin a call
    is held back until the next delta settles it."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.held = ""
        self.in_call = False
        self.content_only = False  # a whole-reply format whose reply turned out not to be a call
        self.calls = 0  # calls sent so far (each streamed delta's index)

    def push(self, delta: str, last: bool = False) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now) after `delta`; `last` flushes at the end of the reply."""
        text, self.held = self.held + delta, ""
        closing = self.fmt.closing()
        if closing is not None:
            return self._tagged(text, self.fmt.opening(), closing, last)
        if self.content_only:
            return text, []
        start = text.lstrip()
        if not last and (not start or self.fmt.opening().startswith(start[:1]) or self._tag_start(start)):
            self.held = text  # the reply may still be a call: it is one only if it is whole JSON at the end
            return "", []
        if last:
            return self.fmt.split(text)
        self.content_only = True
        return text, []

    @staticmethod
    def _tag_start(start: str) -> bool:
        tag = Llama3Format.TAG
        return start.startswith(tag) or tag.startswith(start)

    def _tagged(self, text: str, opening: str, closing: str, last: bool) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.in_call:
                end = text.find(closing)
                if end < 0:
                    break
                content, found = self.fmt.split(opening + text[: end + len(closing)])
                calls += found
                if not found:
                    out.append(content)
                text, self.in_call = text[end + len(closing) :], False
                continue
            start = text.find(opening)
            if start < 0:
                keep = next(
                    (k for k in range(min(len(text), len(opening) - 1), 0, -1) if opening.startswith(text[-k:])), 0
                )
                out.append(text[: len(text) - keep])
                text = text[len(text) - keep :]
                break
            out.append(text[:start])
            text, self.in_call = text[start + len(opening) :], True
        if last:
            out.append((opening if self.in_call else "") + text)
            text, self.in_call = "", False
        self.held = text
        return "".join(out), calls
