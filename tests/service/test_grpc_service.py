"""End-to-end tests of the public gRPC API against a real `mtpserve serve` on loopback, plus the engine loop."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.detokenizer import IncrementalDetokenizer
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import (
    ROOT,
    ServeProcess,
    child_env,
    dummy_server_config,
    rpc_error,
    wait_for,
    write_dummy_model,
    write_tiny_model,
)

VOCAB = 49152
MAX_RUNNING = 2
PROMPT = [17, 404, 2000, 31, 9, 77, 1234, 5]
SERVER_YAML = {
    "model": {"device": "cpu", "dtype": "float32"},
    "speculative": {"adaptive": False},  # K drafts every step: the counters below count them
    "scheduler": {"max_num_requests": MAX_RUNNING, "max_queue": 1, "num_kv_blocks": 128, "block_size": 16},
    "server": {"port": 1},  # overridden by --port 0: proves flags win over the file
}


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head path) of a tiny tokenizer-backed model."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's YAML config: 2 running slots, a queue of 1, 128 KV blocks."""
    path = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    path.write_text(yaml.safe_dump(SERVER_YAML))
    return path


@pytest.fixture(scope="module")
def server(tiny: tuple[Path, Path], config_file: Path) -> Iterator[ServeProcess]:
    """A running `mtpserve serve`; on teardown SIGTERM must stop it cleanly (exit 0)."""
    model, head = tiny
    proc = ServeProcess(["--config", str(config_file), "--model", str(model), "--draft", str(head)]).start()
    yield proc
    rc = proc.stop()
    assert rc == 0, proc.log
    assert "mtpserve: stopped" in proc.log


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Iterator[MTPServeClient]:
    """A client of the server with a 60 s default deadline."""
    with MTPServeClient(server.address, timeout=60) as c:
        c.wait_ready()
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny: tuple[Path, Path]) -> Any:
    """The served model's tokenizer, for checking text against token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny[0]))


def long_request(request_id: str = "", max_tokens: int = 400, prompt: list[int] = PROMPT) -> pb.GenerateRequest:
    """A request that runs for seconds (ignores EOS)."""
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def wait_idle(client: MTPServeClient, timeout: float = 15.0) -> dict[str, Any]:
    """Wait until nothing runs or waits and every KV block is free; returns the stats."""
    return wait_for(
        lambda: (
            (s := client.stats())["kv_blocks_used"] == 0
            and s["requests_running"] == 0
            and s["requests_waiting"] == 0
            and s
        ),
        timeout,
    )


# ---- health, reflection, model info --------------------------------------------------------------
def test_health_reports_serving(client: MTPServeClient) -> None:
    assert client.health() == "SERVING"
    assert client.health("mtpserve.v1.Inference") == "SERVING"
    err = rpc_error(lambda: client.health("no.such.Service"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services_and_describes_the_api(client: MTPServeClient) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="mtpserve.v1.Inference"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"mtpserve.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    (inference,) = [f for f in files if f.package == "mtpserve.v1"]
    methods = {m.name for s in inference.service for m in s.method}
    assert methods == {"Generate", "Abort", "GetModelInfo", "GetStats"}


def test_model_info(client: MTPServeClient, tiny: tuple[Path, Path]) -> None:
    info = client.model_info()
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["model_name"] == tiny[0].name
    assert (info["vocab_size"], info["max_model_len"], info["tp_size"]) == (VOCAB, 512, 1)
    assert info["has_tokenizer"] is True and info["device"] == "cpu"
    draft = info["draft"]
    assert draft["enabled"] and draft["method"] == "mtp_eagle" and draft["num_draft_tokens"] == 3
    assert draft["source"] == str(tiny[1]) and draft["lookahead_source"] == "prompt"


def test_model_info_names_the_dtype_in_use(tmp_path: Path) -> None:
    """`dtype: auto` is reported as what the weights are in (float32 on the CPU), not as "auto"."""
    from mtpserve.cluster.service.model_info import model_info, served_dtype

    engine = LLMEngine.from_config(dummy_server_config(write_dummy_model(tmp_path)))
    assert engine.cfg.model.dtype == "auto" and model_info(engine).dtype == "float32"
    assert served_dtype("auto", "cuda") == "bfloat16" and served_dtype("float16", "cuda") == "float16"


# ---- streaming -----------------------------------------------------------------------------------
def test_stream_carries_text_deltas_tokens_and_final_stats(client: MTPServeClient, tokenizer: Any) -> None:
    chunks = list(client.stream("Write a haiku about the sea.", max_tokens=40, ignore_eos=True))
    assert len(chunks) >= 2, "expected several chunks, the response was not streamed"
    assert all(c.finish_reason is None for c in chunks[:-1])
    final = chunks[-1]
    ids = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason == "length" and len(ids) == 40
    assert final.usage["completion_tokens"] == 40 and final.usage["prompt_tokens"] > 5  # chat template applied
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)
    s = final.stats
    assert s["verify_steps"] > 0 and s["drafted"] >= s["verify_steps"]
    assert s["accepted"] > 0, "the mimic draft head should get some drafts accepted"
    assert s["acceptance_length"] == pytest.approx(1 + s["accepted"] / s["verify_steps"], abs=1e-5)
    assert len(s["accepted_per_position"]) == 3


def test_generate_is_deterministic_and_matches_the_json_contract(client: MTPServeClient) -> None:
    a = client.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True)
    b = client.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True)
    assert set(a) == {"token_ids", "text", "finish_reason", "stats"}
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 16
    assert set(a["stats"]) == {
        "drafted",
        "accepted",
        "verify_steps",
        "acceptance_rate",
        "acceptance_length",
        "accepted_per_position",
    }


def test_incremental_detokenizer_handles_multibyte_characters(tokenizer: Any) -> None:
    text = "naïve café — 東京 🙂🚀 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for step in (1, 2, 3):
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
        deltas.append(detok.flush())
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


# ---- abort, cancellation, deadlines --------------------------------------------------------------
def test_abort_ends_the_stream_and_frees_blocks(client: MTPServeClient) -> None:
    call = client.stub.Generate(long_request("abort-me"), timeout=60)
    first = next(call)
    assert first.request_id == "abort-me" and first.token_ids
    assert client.stats()["kv_blocks_used"] > 0
    assert client.abort("abort-me") is True
    rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens < 400
    assert client.abort("abort-me") is False
    wait_idle(client)


def test_cancelled_stream_frees_its_blocks(client: MTPServeClient) -> None:
    before = wait_idle(client)
    call = client.stub.Generate(long_request(), timeout=60)
    next(call)
    s = client.stats()
    assert s["requests_running"] == 1 and s["kv_blocks_used"] > 0
    call.cancel()
    after = wait_idle(client)
    assert after["requests_finished"] == before["requests_finished"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 400, "the request ran on after the cancel"


def test_deadline_exceeded_aborts_and_frees_blocks(client: MTPServeClient) -> None:
    """A deadline of a fifth of the time the request needs (timed on this machine first) ends the stream
    with DEADLINE_EXCEEDED, and the request stops well short of its max_tokens."""
    full = 512 - len(PROMPT) - 1  # the longest answer the model length allows
    start = time.perf_counter()
    assert len([t for m in client.stub.Generate(long_request(max_tokens=64), timeout=60) for t in m.token_ids]) == 64
    per_token = (time.perf_counter() - start) / 64
    before = wait_idle(client)
    call = client.stub.Generate(long_request(max_tokens=full), timeout=max(0.05, 0.2 * full * per_token))
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_idle(client)
    assert after["generated_tokens"] - before["generated_tokens"] < full, "the request ran on past its deadline"


# ---- bad inputs while a good stream runs ---------------------------------------------------------
def _req(**kw: Any) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    kw.setdefault("token_ids", pb.TokenIds(ids=PROMPT))
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_LARGE = grpc.StatusCode.RESOURCE_EXHAUSTED  # over the message size a prompt of max_model_len tokens needs
BAD_INPUTS: list[tuple[str, pb.GenerateRequest, grpc.StatusCode, str]] = [
    ("no prompt", pb.GenerateRequest(), INVALID, "prompt:"),
    ("empty token ids", _req(token_ids=pb.TokenIds(ids=[])), INVALID, "prompt:"),
    ("empty text", pb.GenerateRequest(text=""), INVALID, "prompt.text:"),
    ("prompt too long", _req(token_ids=pb.TokenIds(ids=[5] * 512)), INVALID, "prompt:"),
    ("token id = vocab", _req(token_ids=pb.TokenIds(ids=[1, VOCAB])), INVALID, "prompt.token_ids:"),
    ("negative token id", _req(token_ids=pb.TokenIds(ids=[-1])), INVALID, "prompt.token_ids:"),
    ("max_tokens = 0", _req(sampling={"max_tokens": 0}), INVALID, "sampling.max_tokens:"),
    ("max_tokens < 0", _req(sampling={"max_tokens": -3}), INVALID, "sampling.max_tokens:"),
    ("max_tokens past the model length", _req(sampling={"max_tokens": 510}), INVALID, "sampling.max_tokens: 510 + "),
    ("temperature < 0", _req(sampling={"temperature": -0.5}), INVALID, "sampling.temperature:"),
    ("top_p > 1", _req(sampling={"top_p": 1.5}), INVALID, "sampling.top_p:"),
    ("top_p = 0", _req(sampling={"top_p": 0.0}), INVALID, "sampling.top_p:"),
    ("top_p < 0", _req(sampling={"top_p": -0.1}), INVALID, "sampling.top_p:"),
    ("top_k < 0", _req(sampling={"top_k": -1}), INVALID, "sampling.top_k:"),
    ("stop token outside vocab", _req(sampling={"stop_token_ids": [VOCAB + 1]}), INVALID, "sampling.stop_token_ids:"),
    ("request id in flight", _req(request_id="good"), INVALID, "request_id:"),
    ("request id of 4 MB", _req(request_id="r" * (4 << 20)), TOO_LARGE, "SERVER: Received message larger"),
    ("text of 16 MB", pb.GenerateRequest(text="ab " * ((16 << 20) // 3)), TOO_LARGE, "SERVER: Received message larger"),
    ("text of 300 KB", pb.GenerateRequest(text="ab " * 100_000), INVALID, "prompt.text: has 300000 bytes"),
    ("request id of 257 characters", _req(request_id="r" * 257), INVALID, "request_id:"),
]


def test_bad_inputs_are_refused_while_a_good_stream_completes(client: MTPServeClient) -> None:
    wait_idle(client)
    good: dict[str, Any] = {}

    def run_good() -> None:
        good["result"] = client.generate(token_ids=PROMPT, request_id="good", max_tokens=500, ignore_eos=True)
        good["done_at"] = time.monotonic()

    thread = threading.Thread(target=run_good)
    thread.start()
    wait_for(lambda: client.stats()["requests_running"] == 1)
    failures = []
    first_refused_at = None
    for name, request, code, field in BAD_INPUTS:
        err = rpc_error(lambda r=request: list(client.stub.Generate(r, timeout=30)))  # type: ignore[misc]
        first_refused_at = first_refused_at or time.monotonic()
        if err.code() != code or not err.details().startswith(field):
            failures.append(f"{name}: got {err.code().name} {err.details()!r}, want {code.name} '{field} ...'")
    deadline_err = rpc_error(lambda: list(client.stub.Generate(long_request(), timeout=0.001)))
    if deadline_err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        failures.append(f"deadline 1 ms: got {deadline_err.code().name}")
    abort_err = rpc_error(lambda: client.stub.Abort(pb.AbortRequest(), timeout=10))
    if abort_err.code() != grpc.StatusCode.INVALID_ARGUMENT or "request_id" not in abort_err.details():
        failures.append(f"abort without id: got {abort_err.code().name} {abort_err.details()!r}")
    thread.join(60)
    assert not failures, "\n".join(failures)
    assert good["result"]["finish_reason"] == "length" and len(good["result"]["token_ids"]) == 500
    assert first_refused_at and good["done_at"] > first_refused_at, "the good stream ended before any refusal"
    wait_idle(client)


def test_malformed_messages_get_invalid_argument(client: MTPServeClient, server: ServeProcess) -> None:
    """Bytes that are no GenerateRequest, or a text field that is not UTF-8, get INVALID_ARGUMENT naming the
    request type (not UNKNOWN with a class name, nor a traceback in the log); the server keeps serving."""
    number = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
    not_utf8 = bytes([number << 3 | 2, 2, 0xFF, 0xFE])  # field `text`, length 2, two bytes that are not UTF-8
    with grpc.insecure_channel(server.address) as channel:
        generate = channel.unary_stream("/mtpserve.v1.Inference/Generate")  # bytes in, bytes out
        for raw in (b"\xff\xff\xff\xff", not_utf8):
            err = rpc_error(lambda r=raw: list(generate(r, timeout=30)))  # type: ignore[misc]
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert err.details().startswith("request: not a valid mtpserve.v1.GenerateRequest"), err.details()
        abort = channel.unary_unary("/mtpserve.v1.Inference/Abort")
        assert rpc_error(lambda: abort(b"\xff\xff", timeout=30)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in server.log
    assert len(client.generate(token_ids=PROMPT, max_tokens=3)["token_ids"]) == 3


def test_queue_full_gives_resource_exhausted(client: MTPServeClient) -> None:
    wait_idle(client)
    calls = []
    try:
        for i in range(MAX_RUNNING):
            calls.append(client.stub.Generate(long_request(f"run-{i}"), timeout=60))
            next(calls[-1])
        assert client.stats()["requests_running"] == MAX_RUNNING
        calls.append(client.stub.Generate(long_request("queued"), timeout=60))
        wait_for(lambda: client.stats()["requests_waiting"] == 1)
        err = rpc_error(lambda: list(client.stub.Generate(long_request("one-too-many"), timeout=30)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in err.details()
    finally:
        for call in calls:
            call.cancel()
    wait_idle(client)


# ---- stats, metrics, CLI -------------------------------------------------------------------------
def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_get_stats_and_prometheus_metrics(client: MTPServeClient, server: ServeProcess) -> None:
    before = wait_idle(client)
    client.generate(token_ids=PROMPT, max_tokens=20, ignore_eos=True)
    s = wait_idle(client)
    assert s["kv_blocks_total"] == 128
    assert s["requests_finished"] == before["requests_finished"] + 1
    assert s["generated_tokens"] == before["generated_tokens"] + 20
    t = s["totals"]
    assert t["drafted"] > before["totals"]["drafted"] and t["verify_steps"] > 0 and t["accepted"] > 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert _metric(text, 'mtpserve_requests_total{finish_reason="length",frontend="grpc"}') >= 1
    assert _metric(text, 'mtpserve_generation_tokens_total{frontend="grpc"}') >= s["generated_tokens"]
    assert _metric(text, 'mtpserve_prompt_tokens_total{frontend="grpc"}') >= len(PROMPT)
    assert _metric(text, 'mtpserve_time_to_first_token_seconds_count{frontend="grpc"}') >= 1
    assert _metric(text, 'mtpserve_time_per_output_token_seconds_count{frontend="grpc"}') >= 1
    assert _metric(text, "mtpserve_spec_drafted_tokens_total") == t["drafted"]
    assert _metric(text, "mtpserve_spec_accepted_tokens_total") == t["accepted"]
    assert _metric(text, 'mtpserve_spec_accepted_per_position_total{position="0"}') >= 1
    assert _metric(text, 'mtpserve_spec_drafted_per_position_total{position="2"}') >= 1
    assert _metric(text, "mtpserve_queue_depth") == 0 and _metric(text, "mtpserve_kv_cache_usage_ratio") == 0
    assert _metric(text, "mtpserve_spec_depth") == 3  # the depth a fixed K=3 chain runs
    assert _metric(text, 'mtpserve_spec_steps_per_depth_total{depth="3"}') >= 5, "20 tokens, at most 4 a step"
    assert 'mtpserve_spec_steps_per_depth_total{depth="1"}' not in text, "no step ran another kind"


def test_prefix_cache_hits_show_in_get_stats_and_metrics(client: MTPServeClient, server: ServeProcess) -> None:
    shared = [(7 * i + 3) % 2000 + 10 for i in range(40)]  # 2 full blocks of 16, and 8 tokens
    before = wait_idle(client)
    first = client.generate(token_ids=shared, max_tokens=6, ignore_eos=True)
    again = client.generate(token_ids=shared, max_tokens=6, ignore_eos=True)
    s = wait_idle(client)
    assert again["token_ids"] == first["token_ids"]
    assert s["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"] == 2 * len(shared)
    assert s["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 32, "the second request reuses 2 blocks"
    assert s["kv_blocks_cached"] >= 2 and 0 < s["prefix_cache_hit_rate"] < 1
    assert s["prefix_cache_hit_rate"] == pytest.approx(s["prefix_cache_hit_tokens"] / s["prefix_cache_query_tokens"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert _metric(text, "mtpserve_prefix_cache_hit_tokens_total") == s["prefix_cache_hit_tokens"]
    assert _metric(text, "mtpserve_prefix_cache_query_tokens_total") == s["prefix_cache_query_tokens"]
    assert _metric(text, "mtpserve_kv_blocks_cached") == s["kv_blocks_cached"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtpserve", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_cli_against_the_server(server: ServeProcess) -> None:
    out = _cli("generate", "--server", server.address, "--prompt", "Hi there", "--max-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert set(obj) == {"token_ids", "text", "finish_reason", "stats"}
    assert 1 <= len(obj["token_ids"]) <= 8 and obj["finish_reason"] in {"stop", "length"}
    streamed = _cli("generate", "--server", server.address, "--prompt", "Hi there", "--max-tokens", "8")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip("\n") == obj["text"].rstrip("\n")
    assert "finish=" in streamed.stderr
    bad = _cli("generate", "--server", server.address, "--prompt", "Hi", "--max-tokens", "0")
    assert bad.returncode != 0
    assert "mtpserve: INVALID_ARGUMENT: sampling.max_tokens:" in bad.stderr


def test_serve_print_config_merges_yaml_and_flags(config_file: Path) -> None:
    out = _cli("serve", "--config", str(config_file), "--port", "0", "--tp", "1", "--print-config")
    assert out.returncode == 0, out.stderr
    cfg = MTPServeConfig.model_validate(yaml.safe_load(out.stdout))
    assert cfg.server.port == 0 and cfg.scheduler.max_queue == 1 and cfg.scheduler.num_kv_blocks == 128
    bad = _cli("serve", "--config", str(config_file), "--port", "70000", "--print-config")
    assert bad.returncode == 2 and "server.port" in bad.stderr


# ---- generated code is current -------------------------------------------------------------------
def test_generated_proto_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "proto" / "gen.sh"), str(tmp_path)], check=True, env=child_env(PYTHON=sys.executable)
    )
    fresh = sorted(p.name for p in (tmp_path / "mtpserve" / "v1").iterdir() if p.is_file())
    assert "inference_pb2.py" in fresh and "inference_pb2_grpc.py" in fresh
    committed = ROOT / "proto" / "mtpserve" / "v1"
    stale = [
        n
        for n in fresh
        if not (committed / n).is_file() or not filecmp.cmp(tmp_path / "mtpserve/v1" / n, committed / n, shallow=False)
    ]
    assert not stale, f"run proto/gen.sh: {stale} differ from the .proto"
