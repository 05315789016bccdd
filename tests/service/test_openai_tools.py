"""Tools through `mtpserve serve` with the official openai client: a tiny Qwen2-architecture model whose chat
template renders tools and calls in Qwen's format, a required or named call forced by a grammar, parsed into
`tool_calls` whole and streamed as `delta.tool_calls`, with speculation on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import yaml

from tests.helpers.hf_tiny import write_hf_target
from tests.helpers.service import TOKENIZER_FILES, ServeProcess, default_tokenizer_dir

# Qwen's tool-calling layout (tools listed in <tools></tools> in a system turn, calls in <tool_call></tool_call>,
# results in <tool_response></tool_response>), written out here for a tiny model.
TEMPLATE = """
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

Function signatures are listed within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

To call a function, answer with its name and arguments as JSON within <tool_call></tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and tools %}
{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, openai.OpenAI]]:
    path = tmp_path_factory.mktemp("qwen2-tiny")
    write_hf_target(path, "qwen2", mimic=True, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    src = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and name != "chat_template.jinja":
            shutil.copy(src / name, path / name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"device": "cpu", "dtype": "float32"}}))
    args = ["--config", str(cfg), "--model", str(path), "--draft", "random", "--http-port", "0"]
    proc = ServeProcess(args).start()
    assert proc.http_port, proc.log
    yield proc, openai.OpenAI(base_url=f"{proc.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert proc.stop() == 0, proc.log


def _model(proc: ServeProcess) -> str:
    return Path(proc.cmd[proc.cmd.index("--model") + 1]).name


def test_named_tool_call_is_parsed_whole(served: Any) -> None:
    proc, client = served
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=_model(proc), messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0.9, seed=2
    )
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = c.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)  # type: ignore[union-attr]


def test_required_tool_call_streams_as_delta_tool_calls(served: Any) -> None:
    proc, client = served
    messages = [
        {"role": "user", "content": "What time is it, and the weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    stream = client.chat.completions.create(
        model=_model(proc),
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas, reasons, content, usage = [], [], "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and content == ""
    assert usage is not None and usage.completion_tokens > 5, "the usage chunk counts the call's tokens"
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id and deltas[0].function is not None
    name, arguments = deltas[0].function.name, json.loads(deltas[0].function.arguments or "")
    assert name in ("get_weather", "get_time")
    if name == "get_weather":
        jsonschema.validate(arguments, WEATHER)


def test_auto_leaves_prose_as_content_and_bad_choices_are_refused(served: Any) -> None:
    proc, client = served
    messages = [{"role": "user", "content": "Say hi."}]
    reply = client.chat.completions.create(model=_model(proc), messages=messages, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=_model(proc),
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert bad.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_tools_over_grpc(served: Any) -> None:
    import grpc

    from mtpserve.cluster.client import Chat, MTPServeClient
    from mtpserve.cluster.service.client import build_request

    proc, _ = served
    tools = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    turns = [{"role": "user", "content": "Weather in Oslo?"}]
    with MTPServeClient(proc.address, timeout=60) as client:
        out = client.generate(Chat(turns, tools, "get_weather"), max_tokens=80, temperature=0.7, seed=2)
        assert out["finish_reason"] == "tool_calls" and out["text"] == ""
        (call,) = out["tool_calls"]
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
        answer = {"role": "tool", "content": "4 C", "tool_call_id": call["id"]}
        answered = [*turns, {"role": "assistant", "tool_calls": [call]}, answer]
        prose = client.generate(Chat(answered, tools, "none"), max_tokens=6)
        assert prose["finish_reason"] == "length" and "tool_calls" not in prose
        with pytest.raises(Exception, match="tool_choice"):
            client.generate(Chat(turns, tools, "nope"), max_tokens=4)
        bad = build_request(Chat(turns, [{"name": "f"}]), max_tokens=4)
        bad.tools[0].parameters_json = "{not json"
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0].parameters_json" in str(
            err.value.details()
        )
