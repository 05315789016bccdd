"""The OpenAI-compatible HTTP API against a real `mtpserve serve --http-port` on loopback, called with the real
`openai` client (and raw HTTP for what the client would not send), plus health and failures in process."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from mtpserve.cluster.service.client import MTPServeClient
from tests.helpers.service import ROOT, ServeProcess, child_env, wait_for, write_dummy_model, write_tiny_model

VOCAB = 49152
MAX_LEN = 512
SERVER_YAML = {
    "model": {"device": "cpu", "dtype": "float32"},
    "scheduler": {"max_num_requests": 32, "max_queue": 1024, "num_kv_blocks": 512, "block_size": 16},
    "server": {"http_max_body_mb": 1},
}
QUESTION = "Write a haiku about the sea."


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head path) of a tiny model with SmolLM2's tokenizer and chat template."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """`mtpserve serve --http-port 0`; SIGTERM must stop it cleanly."""
    config = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVER_YAML))
    model, head = tiny
    args = ["--config", str(config), "--model", str(model), "--draft", str(head), "--http-port", "0"]
    proc = ServeProcess(args).start()
    assert proc.http_port, proc.log
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    """The openai client of the server (no retries: every error must surface)."""
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(server: ServeProcess) -> Iterator[MTPServeClient]:
    """A gRPC client of the same server, for its KV and request counters."""
    with MTPServeClient(server.address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny: tuple[Path, Path]) -> Any:
    """The served model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny[0]))


@pytest.fixture(scope="module")
def model_id(tiny: tuple[Path, Path]) -> str:
    """The id the server gives its model: the model directory's name."""
    return tiny[0].name


def wait_idle(c: MTPServeClient, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until nothing runs or waits and every KV block is free; returns the stats."""
    return wait_for(
        lambda: (
            (s := c.stats())["kv_blocks_used"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0 and s
        ),
        timeout,
    )


def http(
    method: str, url: str, body: bytes | dict[str, Any] | None = None, token: str | None = None
) -> tuple[int, Any]:
    """(status, decoded JSON body) of one raw HTTP call."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- models, health ------------------------------------------------------------------------------
def test_models_and_health(client: openai.OpenAI, server: ServeProcess, model_id: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] and models[0].owned_by == "mtpserve"
    assert http("GET", f"{server.http_url}/health") == (200, {"status": "serving"})


# ---- completions ---------------------------------------------------------------------------------
def test_chat_whole_and_streamed_agree_with_right_usage(client: openai.OpenAI, tokenizer: Any, model_id: str) -> None:
    """A greedy chat completion, whole and streamed: same text and tokens; usage counts the chat-templated
    prompt and the answer's tokens; the speculative figures add up."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, extra_body=extra)
    choice = whole.choices[0]
    ids = choice.token_ids  # type: ignore[attr-defined]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and len(ids) == 20
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt), 20, len(prompt) + 20)
    spec = usage.speculative  # type: ignore[attr-defined]
    assert spec["verify_steps"] > 0 and spec["drafted"] >= spec["verify_steps"] and spec["accepted"] > 0
    assert spec["acceptance_length"] == pytest.approx(1 + spec["accepted"] / spec["verify_steps"], abs=1e-5)

    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) >= 4, "the answer was not streamed"
    *body, final = chunks
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 20
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body].count("length") == 1 and body[-1].choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert [t for c in body for t in c.choices[0].token_ids] == ids  # type: ignore[attr-defined]


def test_stream_is_server_sent_events_ending_with_done(server: ServeProcess, model_id: str) -> None:
    """On the wire: text/event-stream, every event one `data: ...` line and a blank line, the last `[DONE]`."""
    body = json.dumps({"model": model_id, "prompt": "Hello", "max_tokens": 5, "stream": True}).encode()
    req = urllib.request.Request(f"{server.http_url}{TEXT}", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") and chunks[0]["object"] == "text_completion"


def test_text_completion_whole_and_streamed(client: openai.OpenAI, tokenizer: Any, model_id: str) -> None:
    """/v1/completions takes the prompt as is: text without the chat template, or token ids."""
    prompt = "The tide rolls in and"
    whole = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=model_id, prompt=prompt, max_tokens=12, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert len(streamed) >= 2 and streamed[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=12, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == whole.choices[0].text


def _generate_local(tiny: tuple[Path, Path], *args: str) -> dict[str, Any]:
    model, head = tiny
    cmd = [sys.executable, "-m", "mtpserve", "generate", "--local", "--model", str(model), "--draft", str(head)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--json", *args]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_greedy_text_equals_generate_local(client: openai.OpenAI, tiny: tuple[Path, Path], model_id: str) -> None:
    """The same prompt and settings give the same greedy text as `mtpserve generate --local`, through the
    chat template (chat) and without it (text completion)."""
    local = _generate_local(tiny, "--prompt", QUESTION, "--max-tokens", "24")
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].token_ids == local["token_ids"]  # type: ignore[attr-defined]
    assert chat.choices[0].message.content == local["text"] and chat.choices[0].finish_reason == local["finish_reason"]
    raw = _generate_local(tiny, "--prompt", "Once upon a time", "--max-tokens", "16", "--raw")
    text = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert text.choices[0].text == raw["text"] and text.usage.completion_tokens == len(raw["token_ids"])


def test_stop_strings_cut_the_text_and_end_the_request(
    client: openai.OpenAI, grpc_client: MTPServeClient, model_id: str, tokenizer: Any
) -> None:
    """A stop string taken from the middle of a greedy answer ends it there (whole and streamed), with
    finish_reason "stop"; the tokens and their count end at the token that completes the stop string, although a
    speculative step brings more; the request is gone from the engine afterwards."""
    kw: dict[str, Any] = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    ids_on = {"ignore_eos": True, "return_token_ids": True}
    full_ids = client.completions.create(**kw, extra_body=ids_on).choices[0].token_ids
    full = tokenizer.decode(full_ids, skip_special_tokens=True)
    wait_idle(grpc_client)
    before = grpc_client.stats()["generated_tokens"]
    for at in (len(full) // 4, len(full) // 3, len(full) // 2):
        stop = full[at : at + 3]
        cut = full[: full.index(stop)]
        upto = next(k for k in range(1, 41) if stop in tokenizer.decode(full_ids[:k], skip_special_tokens=True))
        whole = client.completions.create(**kw, stop=[stop, "never-in-this-text"], extra_body=ids_on)
        assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].token_ids == full_ids[:upto] and whole.usage.completion_tokens == upto
        streamed = list(
            client.completions.create(
                **kw, stop=stop, stream=True, stream_options={"include_usage": True}, extra_body=ids_on
            )
        )
        chunks = [c for c in streamed if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
        assert [t for c in chunks for t in c.choices[0].token_ids or []] == full_ids[:upto]
        assert streamed[-1].usage.completion_tokens == upto
    after = wait_idle(grpc_client)
    assert after["generated_tokens"] - before < 6 * 40, "a request ran on past its stop string"


def test_seeded_sampling_repeats(client: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = {"model": model_id, "prompt": "Hello", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9}
    a = client.completions.create(**kw, seed=11, extra_body={"ignore_eos": True}).choices[0].text
    b = client.completions.create(**kw, seed=11, extra_body={"ignore_eos": True}).choices[0].text
    assert a == b


def test_client_disconnect_mid_stream_frees_the_request(
    server: ServeProcess, grpc_client: MTPServeClient, model_id: str
) -> None:
    """Closing a stream after two chunks aborts the request: nothing runs and every KV block is free soon
    after, long before its 400 tokens would have been generated."""
    before = wait_idle(grpc_client)
    c = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = c.completions.create(
        model=model_id, prompt=[5, 6, 7, 8], max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it), next(it)
    assert grpc_client.stats()["kv_blocks_used"] > 0
    stream.close()
    c.close()
    after = wait_idle(grpc_client)
    assert after["requests_finished"] == before["requests_finished"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 400, "the request ran on after the disconnect"


# ---- bad inputs ----------------------------------------------------------------------------------
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    ("negative max_tokens", CHAT, {"messages": USER, "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", TEXT, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens past the model length", CHAT, {"messages": USER, "max_tokens": 100_000}, 400, "max_tokens"),
    ("max_tokens past int32", TEXT, {"prompt": "hi", "max_tokens": 2**40}, 400, "max_tokens"),
    (
        "max_completion_tokens too big",
        CHAT,
        {"messages": USER, "max_completion_tokens": 600},
        400,
        "max_completion_tokens",
    ),
    (
        "NaN temperature",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("infinite top_p", TEXT, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ("temperature above 2", CHAT, {"messages": USER, "temperature": 2.5}, 400, "temperature"),
    ("negative temperature", TEXT, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("top_p 0", TEXT, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("no messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("function role", CHAT, {"messages": [*USER, {"role": "function", "content": "x"}]}, 400, "messages[1].role"),
    (
        "image content",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": USER}, 404, "model"),
    ("not JSON", CHAT, b"{messages: hi", 400, None),
    ("JSON but not an object", TEXT, b"[1, 2]", 400, "body"),
    ("n = 17", CHAT, {"messages": USER, "n": 17}, 400, "n"),
    ("n = 0", TEXT, {"prompt": "hi", "n": 0}, 400, "n"),
    ("best_of = 2", TEXT, {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("logprobs over 20", TEXT, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logit_bias key not a token id", TEXT, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (
        "logit_bias token outside the vocabulary",
        TEXT,
        {"prompt": "hi", "logit_bias": {str(VOCAB): 1}},
        400,
        "logit_bias",
    ),
    ("logit_bias over 100", TEXT, {"prompt": "hi", "logit_bias": {"3": 150}}, 400, "logit_bias"),
    ("presence_penalty over 2", CHAT, {"messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("min_tokens over max_tokens", TEXT, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    (
        "response_format yaml",
        CHAT,
        {"messages": USER, "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    (
        "json_schema missing",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "two structured kinds",
        TEXT,
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
    ),
    ("tool without a function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    (
        "stop string kept as text",
        TEXT,
        {"prompt": "hi", "include_stop_str_in_output": "yes"},
        400,
        "include_stop_str_in_output",
    ),
    ("echo with logprobs", TEXT, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("suffix", TEXT, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("five stop strings", TEXT, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("prompt too long", TEXT, {"prompt": [7] * MAX_LEN}, 400, "prompt"),
    ("token id outside the vocabulary", TEXT, {"prompt": [1, VOCAB]}, 400, "prompt"),
    ("empty prompt", TEXT, {"prompt": ""}, 400, "prompt"),
    ("body over http_max_body_mb", TEXT, b'{"prompt": "' + b"a" * (1024 * 1024 + 10) + b'"}', 413, None),
    ("text longer than any prompt of the model", TEXT, {"prompt": "a b " * 30_000}, 400, "prompt"),
    (
        "messages longer than any prompt",
        CHAT,
        {"messages": [{"role": "user", "content": "ab " * 40_000}]},
        400,
        "messages",
    ),
    ("repetition_penalty 0", TEXT, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens below 0", TEXT, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("min_p over 1", CHAT, {"messages": USER, "min_p": 1.5}, 400, "min_p"),
    ("max_tokens as a string", TEXT, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens as a bool", TEXT, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("stream as a string", TEXT, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("JSON nested too deeply", TEXT, b"[" * 200_000 + b"]" * 200_000, 400, None),
    ("lone surrogate in a text prompt", TEXT, b'{"prompt": "hi \\ud800"}', 400, "prompt"),
    (
        "lone surrogate in a message",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
        400,
        "messages[0].content",
    ),
]


def test_bad_inputs_get_openai_errors_while_a_good_stream_completes(
    server: ServeProcess, client: openai.OpenAI, grpc_client: MTPServeClient, model_id: str
) -> None:
    """Each bad request gets its status and an OpenAI error body naming the field; a stream running
    meanwhile completes untouched, and nothing is left running afterwards."""
    wait_idle(grpc_client)
    good: dict[str, Any] = {}

    def run_good() -> None:
        stream = client.completions.create(
            model=model_id, prompt=[9, 8, 7], max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        good["text"] = [c.choices[0] for c in stream]
        good["done_at"] = time.monotonic()

    thread = threading.Thread(target=run_good)
    thread.start()
    wait_for(lambda: grpc_client.stats()["requests_running"] == 1)
    failures = []
    for name, path, body, status, param in BAD_INPUTS:
        got, obj = http("POST", server.http_url + path, body)
        err = obj.get("error") if isinstance(obj, dict) else None
        ok = got == status and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
        if not ok or err["param"] != param or (param and not err["message"].startswith(f"{param}: ")):  # type: ignore[index]
            failures.append(f"{name}: got {got} {obj}, want {status} naming {param}")
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", CHAT, 405)):
        got, obj = http(method, server.http_url + path)
        if got != status or "error" not in obj:
            failures.append(f"{method} {path}: got {got} {obj}")
    bad_done_at = time.monotonic()
    thread.join(120)
    assert not failures, "\n".join(failures)
    assert good["text"][-1].finish_reason == "length" and good["done_at"] > bad_done_at
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_id, messages=USER, max_tokens=-5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert client.completions.create(model=model_id, prompt="hi", max_tokens=2).choices[0].finish_reason
    neutral = {"repetition_penalty": 1.0, "min_tokens": 0, "min_p": 0.0}  # what they would not change is fine
    assert client.completions.create(model=model_id, prompt="hi", max_tokens=2, extra_body=neutral).choices
    wait_idle(grpc_client)


def test_metrics_are_labelled_by_front_end(client: openai.OpenAI, server: ServeProcess, model_id: str) -> None:
    client.completions.create(model=model_id, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", page, re.MULTILINE)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    assert value('mtpserve_requests_total{finish_reason="length",frontend="http"}') >= 1
    assert value('mtpserve_generation_tokens_total{frontend="http"}') >= 3
    assert value('mtpserve_time_to_first_token_seconds_count{frontend="http"}') >= 1
    assert value('mtpserve_e2e_request_latency_seconds_count{frontend="http"}') >= 1
    itl = value('mtpserve_inter_token_latency_seconds_count{frontend="http"}')
    assert itl >= 1, "the outputs after the first each have a gap"
    assert 0 < value('mtpserve_inter_token_latency_seconds_sum{frontend="http"}') / itl < 5
    for phase in ("queue", "prefill", "decode"):
        assert value(f'mtpserve_request_{phase}_time_seconds_count{{frontend="http"}}') >= 1, phase
    assert value('mtpserve_request_prefill_time_seconds_sum{frontend="http"}') > 0
    steps = value("mtpserve_engine_steps_total")
    assert steps >= 3 and value("mtpserve_engine_step_rows_total") >= steps  # a step computes a row at least
    assert value("mtpserve_preemptions_total") == 0
    assert value("mtpserve_engine_steps_launched_total") == 0, "on the CPU every step runs in turn"
    info = re.search(r"^mtpserve_model_info\{([^}]*)\} 1\.0$", page, re.MULTILINE)
    assert info and f'model_name="{model_id}"' in info.group(1) and 'draft_method="mtp_eagle"' in info.group(1)


def test_serve_refuses_a_taken_http_port_and_a_clash(tmp_path: Path) -> None:
    """An HTTP port already in use stops `serve` with exit code 2 naming it; the same number as the gRPC port
    is refused by the config, naming server.http_port."""
    model = write_dummy_model(tmp_path / "dummy")
    base = [sys.executable, "-m", "mtpserve", "serve", "--model", str(model), "--load-format", "dummy"]
    base += ["--device", "cpu", "--port", "0", "--metrics-port", "0"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*base, "--http-port", str(port)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
        )
    assert out.returncode == 2 and f"http_port {port}" in out.stderr, out.stderr
    clash = subprocess.run(
        [*base, "--port", "8000", "--http-port", "8000", "--print-config"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert clash.returncode == 2 and "server.http_port 8000 is already" in clash.stderr
