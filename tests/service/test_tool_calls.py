"""Tool-call formats: whole replies and streamed ones split into content and calls the same way."""

from __future__ import annotations

import json

import pytest

from mtpserve.cluster.service.tool_calls import HermesFormat, Llama3Format, StreamedCalls, ToolFormat, tool_format

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
HERMES = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL.replace('Oslo', 'Rome')}\n</tool_call>"
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def _streamed(fmt: ToolFormat, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    stream = StreamedCalls(fmt)
    content, calls = [], []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        c, found = stream.push(piece, last=i == len(pieces) - 1)
        content.append(c)
        calls += [(f.name, f.arguments) for f in found]
    return "".join(content), calls


def test_hermes_calls_whole_and_streamed() -> None:
    content, calls = HermesFormat().split(HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)["city"]) for c in calls] == [
        ("get_weather", "Oslo"),
        ("get_weather", "Rome"),
    ]
    for step in (1, 3, 7, 1000):
        streamed_content, streamed_calls = _streamed(HermesFormat(), HERMES, step)
        assert streamed_content.strip() == content and streamed_calls == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    "text", ["no calls here <tool", "a <tool_call>not json</tool_call> b", '<tool_call>{"name": 1}']
)
def test_text_that_only_looks_like_a_call_stays_content(text: str) -> None:
    content, calls = HermesFormat().split(text)
    assert calls == [] and content == text
    for step in (1, 4):
        assert _streamed(HermesFormat(), text, step) == (text, [])


def test_llama3_calls_whole_and_streamed() -> None:
    content, calls = Llama3Format().split(LLAMA)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert _streamed(Llama3Format(), LLAMA, 2) == ("", [("get_weather", calls[0].arguments)])
    prose = "Oslo is cold today."
    assert _streamed(Llama3Format(), prose, 3) == (prose, [])
    assert Llama3Format().split('{"city": "Oslo"}')[1] == [], "JSON without a name is no call"


def test_format_by_architecture() -> None:
    assert isinstance(tool_format("Qwen2ForCausalLM"), HermesFormat)
    assert isinstance(tool_format("LlamaForCausalLM"), Llama3Format)
