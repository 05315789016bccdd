"""The engine in a process of its own (`server.engine_process`, the default of `mtpserve serve`): the same answers
as the engine on a thread, refusals that name the field, no KV blocks left behind, and a server that reports
NOT_SERVING and fails its streams when the engine process dies."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtpserve.cluster.bench.procs import process_tree
from mtpserve.cluster.engine.errors import InvalidRequestError, ModelLoadError, MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.actor_front_ends import FrontEndProcess
from mtpserve.cluster.service.child_link import (
    ABORT,
    ADD,
    ADDED,
    BATCH,
    FAIL,
    OUT,
    STOP,
    STOPPED,
    pack_outputs,
    portable,
    unpack_outputs,
)
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.engine_child import PipedEngine, send_ready
from mtpserve.cluster.service.engine_process import EngineProcess
from mtpserve.cluster.service.request_book import EngineFailure
from mtpserve.cluster.service.server import MTPServer
from mtpserve.speculative.stats import SpecStats
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import ServeProcess, rpc_error, wait_for, write_tiny_model

PROMPTS: list[dict[str, Any]] = [
    {"prompt": "Name three rivers in Europe.", "max_tokens": 24},
    {"token_ids": [28, 2365, 314, 3434, 17], "max_tokens": 40, "ignore_eos": True},
    {"prompt": "Write a haiku about rain.", "max_tokens": 20, "temperature": 0.8, "seed": 7},
]


def _config(model: Path, head: Path) -> MTPServeConfig:
    return MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "device": "cpu"},
            "speculative": {"draft": str(head), "num_draft_tokens": 2, "adaptive": False},  # counters compared
            "scheduler": {"num_kv_blocks": 64, "max_num_requests": 4},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": 0},
        }
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head) of a tiny model with SmolLM2's tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny: tuple[Path, Path]) -> Iterator[MTPServer]:
    """A server whose engine runs in a child process, gRPC and HTTP on free ports, metrics off."""
    srv = MTPServer(None, _config(*tiny), metrics=False)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: MTPServer) -> Iterator[MTPServeClient]:
    """A client of `server`."""
    with MTPServeClient(server.address, timeout=60) as c:
        yield c


def _answers(client: MTPServeClient) -> list[dict[str, Any]]:
    return [client.generate(**p) for p in PROMPTS]


def test_the_engine_runs_in_another_process(server: MTPServer) -> None:
    assert isinstance(server.loop, EngineProcess)
    assert server.loop.pid is not None and server.loop.pid != os.getpid()


def test_answers_and_model_info_equal_those_of_the_engine_on_a_thread(
    server: MTPServer, client: MTPServeClient, tiny: tuple[Path, Path]
) -> None:
    in_child = _answers(client)
    info = client.model_info()
    threaded = MTPServer(LLMEngine.from_config(_config(*tiny)), metrics=False)
    threaded.start()
    try:
        with MTPServeClient(threaded.address, timeout=60) as local:
            assert _answers(local) == in_child  # tokens, text, finish reason and acceptance counters
            assert local.model_info() == info
    finally:
        threaded.stop()
    assert len(in_child[1]["token_ids"]) == 40 and in_child[0]["text"]
    stats = client.stats()
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0
    assert stats["requests_finished"] >= len(PROMPTS)


def test_refusals_name_the_field_and_the_engine_serves_on(client: MTPServeClient, server: MTPServer) -> None:
    vocab = server.loop.info.vocab_size
    err = rpc_error(lambda: client.generate(token_ids=[1, vocab], max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt.token_ids:")
    err = rpc_error(lambda: client.generate(token_ids=[5] * 600, max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt")
    assert len(client.generate(token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True)["token_ids"]) == 5
    assert wait_for(lambda: client.stats()["kv_blocks_used"] == 0)


def test_a_cancelled_stream_and_an_aborted_request_free_their_blocks(client: MTPServeClient) -> None:
    stream = client.stream(token_ids=[9, 8, 7, 6], max_tokens=400, ignore_eos=True)
    next(stream)
    stream.close()  # cancels the call
    chunks = client.stream(token_ids=[3, 4, 5], request_id="stop-me", max_tokens=400, ignore_eos=True)
    first = next(chunks)
    assert client.abort("stop-me")
    rest = list(chunks)
    assert rest[-1].finish_reason == "abort"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 400
    assert wait_for(lambda: (s := client.stats())["kv_blocks_used"] == 0 and s["requests_running"] == 0)
    assert not client.abort("stop-me")


def test_requests_given_up_while_the_engine_adds_them_end_there_too(server: MTPServer) -> None:
    """A cancel or an abort that reaches the server before the engine process has answered the add, and an abort
    from a callback of the add's future (run by the thread that resolves it), all leave nothing running."""
    proc = server.loop
    assert isinstance(proc, EngineProcess)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    early = proc.submit_nowait([5, 6, 7], params)
    if not early.cancel():  # the engine was quicker than this thread
        proc.abort(early.result(30).request_id)
    aborted = proc.submit_nowait([5, 6, 8], params, request_id="abort-early")
    assert proc.abort("abort-early")
    handle = aborted.result(30)
    assert wait_for(lambda: bool(handle.events) and getattr(handle.events[-1], "finish_reason", None) == "abort")
    in_callback = proc.submit_nowait([5, 6, 9], params)
    in_callback.add_done_callback(lambda f: proc.abort(f.result().request_id, wait=False))
    in_callback.result(30)
    assert wait_for(lambda: (s := proc.snapshot).running == 0 and s.waiting == 0 and s.kv_blocks_used == 0, 30)
    last = proc.submit_nowait([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)).result(30)
    assert wait_for(lambda: any(getattr(e, "finished", False) for e in list(last.events)), 30)


def test_stop_ends_streams_in_flight_and_the_engine_process_exits_cleanly(tiny: tuple[Path, Path]) -> None:
    srv = MTPServer(None, _config(*tiny), metrics=False)
    assert srv.loop.snapshot.kv_blocks_total == 64  # published before the first step
    srv.start()
    try:
        with MTPServeClient(srv.address, timeout=60) as c:
            assert c.stats()["kv_blocks_total"] == 64
            stream = c.stream(token_ids=[9, 8, 7], max_tokens=500, ignore_eos=True)
            next(stream)
            srv.stop(grace=0.2)
            err = rpc_error(lambda: list(stream))
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        srv.stop(grace=0.2)
    assert isinstance(srv.loop, EngineProcess) and srv.loop._proc.exitcode == 0
    assert srv.loop.snapshot.running == 0


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_api_runs_over_the_engine_process(server: MTPServer) -> None:
    url = f"http://{server.http_address}"
    _, models = _http(f"{url}/v1/models")
    assert models["data"][0]["id"] == server.loop.info.model_name
    body = {"model": models["data"][0]["id"], "prompt": "One, two,", "max_tokens": 8, "ignore_eos": True}
    status, out = _http(f"{url}/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 8, out
    status, out = _http(f"{url}/v1/completions", {**body, "temperature": -1})
    assert status == 400 and "temperature" in out["error"]["message"], out


def test_a_dead_engine_process_fails_its_streams_and_the_server_stops_serving(tiny: tuple[Path, Path]) -> None:
    srv = MTPServer(None, _config(*tiny), metrics=False)
    srv.start()
    try:
        with MTPServeClient(srv.address, timeout=60) as c:
            stream = c.stream(token_ids=[9, 8, 7], max_tokens=10_000 // 20, ignore_eos=True)
            next(stream)
            assert isinstance(srv.loop, EngineProcess) and srv.loop.pid is not None
            os.kill(srv.loop.pid, signal.SIGKILL)
            err = rpc_error(lambda: list(stream))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine process exited" in err.details()
            assert wait_for(lambda: c.health() == "NOT_SERVING")
            err = rpc_error(lambda: c.generate(token_ids=[1, 2], max_tokens=2))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=0.5)


def test_a_model_that_cannot_load_raises_the_childs_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = MTPServeConfig.from_dict(
        {"model": {"path": str(tmp_path), "device": "cpu"}, "server": {"port": 0, "metrics_port": 0}}
    )
    with pytest.raises(ModelLoadError, match=r"config\.json: .*vocab_size"):
        MTPServer(None, cfg, metrics=False)


# ---- the child's loop, driven in this process over a pipe ------------------------------------------------------------
def _messages_until(conn: Any, tag: str) -> list[tuple[Any, ...]]:
    got = []
    while True:
        assert conn.poll(60), f"no {tag} within 60 s; got {[m[0] for m in got]}"
        got.append(conn.recv())
        if got[-1][0] == tag:
            return got


def test_a_step_that_raises_fails_the_requests_in_flight_and_frees_their_blocks(tiny: tuple[Path, Path]) -> None:
    engine = LLMEngine.from_config(_config(*tiny))
    step = engine.step
    calls = {"n": 0}

    def failing_once() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return step()

    engine.step = failing_once  # type: ignore[method-assign]
    parent, child = Pipe()
    loop = threading.Thread(target=PipedEngine(engine, child).run)
    loop.start()
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    parent.send((ADD, 0, "a", [5, 6, 7], params))
    got = _messages_until(parent, FAIL)
    assert got[0] == (ADDED, 0, None)
    err, load = got[-1][1], got[-1][2]
    assert isinstance(err, EngineFailure) and "RuntimeError: boom" in str(err)
    assert load.kv_blocks_used == 0 and load.running == 0
    parent.send((ADD, 1, "b", [5, 6, 7], params))
    outs = _messages_until(parent, OUT)
    while not any(o[2] for o in outs[-1][1]):  # until "b" finishes
        outs += _messages_until(parent, OUT)
    assert sum(len(o[1]) for m in outs if m[0] == OUT for o in m[1]) == 30
    parent.send((ADD, 2, "c", [5, 10**9], params))
    added = _messages_until(parent, ADDED)[-1]
    assert isinstance(added[2], InvalidRequestError) and added[2].field == "prompt_token_ids"
    parent.send((ADD, 3, "d", [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True)))
    _messages_until(parent, OUT)  # "d" runs
    parent.send((STOP,))
    stopped = _messages_until(parent, STOPPED)[-1]
    assert stopped[1].running == 0 and stopped[1].kv_blocks_used == 0  # what ran at STOP is aborted
    loop.join(10)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks  # cached blocks count as free


def test_outputs_and_refusals_cross_the_pipe_whole() -> None:
    outs = [
        RequestOutput(
            "r1",
            [4, 5],
            False,
            None,
            num_prompt_tokens=7,
            num_output_tokens=2,
            stats=SpecStats(4, 3, 2, [2, 1], drafted_per_position=[2, 2]),
        ),
        RequestOutput("r2", [], True, "length", num_prompt_tokens=3, num_output_tokens=9),
    ]
    assert unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(outs)))) == outs
    err = pickle.loads(pickle.dumps(portable(InvalidRequestError("sampling.top_p", "must be > 0"))))
    assert isinstance(err, InvalidRequestError) and (err.field, err.reason) == ("sampling.top_p", "must be > 0")

    class Local(Exception):  # cannot be pickled: defined in a function
        pass

    stand_in = portable(Local("bad"))
    assert isinstance(stand_in, EngineFailure) and "Local: bad" in str(stand_in)


def test_serve_exits_with_status_1_when_its_engine_process_dies(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    serve = ServeProcess(["--model", str(model), "--draft", str(head), "--device", "cpu"]).start()
    try:
        assert serve.proc is not None
        engine_pids = [pid for pid in process_tree(serve.proc.pid)[1:] if b"spawn_main" in _cmdline(pid)]
        assert len(engine_pids) == 1, "mtpserve serve should start one engine process"
        os.kill(engine_pids[0], signal.SIGKILL)
        assert serve.proc.wait(30) == 1
        assert "the engine stopped" in serve.log and "engine process exited" in serve.log
    finally:
        serve.stop()


def test_the_engine_process_exits_when_serve_is_killed(tiny: tuple[Path, Path]) -> None:
    model, head = tiny
    serve = ServeProcess(["--model", str(model), "--draft", str(head), "--device", "cpu"]).start()
    try:
        assert serve.proc is not None
        (engine,) = [pid for pid in process_tree(serve.proc.pid)[1:] if b"spawn_main" in _cmdline(pid)]
        serve.proc.kill()
        serve.proc.wait(10)
        assert wait_for(lambda: _gone(engine), 20)
    finally:
        serve.stop()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_batch_of_commands_applies_in_order(tiny: tuple[Path, Path]) -> None:
    engine = LLMEngine.from_config(_config(*tiny))
    parent, child = Pipe()
    loop = threading.Thread(target=PipedEngine(engine, child).run)
    loop.start()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    parent.send((BATCH, [(ADD, 0, "a", [5, 6, 7], params), (ABORT, "a"), (ADD, 1, "b", [5, 6, 8], params)]))
    got = _messages_until(parent, OUT)
    while not any(o[0] == "b" and o[2] for m in got if m[0] == OUT for o in m[1]):
        got += _messages_until(parent, OUT)
    assert [m[1] for m in got if m[0] == ADDED] == [0, 1]
    assert {o[0] for m in got if m[0] == OUT for o in m[1]} == {"b"}, "the aborted request never ran"
    parent.send((BATCH, [(ADD, 2, "c", [5, 6, 9], params), (STOP,), (ADD, 3, "d", [1, 2], params)]))
    assert [m[1] for m in _messages_until(parent, STOPPED) if m[0] == ADDED] == [2]
    loop.join(10)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


# ---- the other split: the engine stays here, the front ends run in a child (the Ray scheduler actor's layout) ----
def test_front_ends_in_a_child_serve_this_engine_and_follow_its_health(tiny: tuple[Path, Path]) -> None:
    cfg = _config(*tiny)
    engine = LLMEngine.from_config(cfg)
    lost = threading.Event()
    front = FrontEndProcess(engine, cfg, on_lost=lost.set)
    try:
        assert front.pid is not None and front.pid != os.getpid()
        with MTPServeClient(front.address, timeout=60) as c:
            out = c.generate(token_ids=[28, 2365, 314], max_tokens=8, ignore_eos=True)
            assert len(out["token_ids"]) == 8 and c.health() == "SERVING"
            for listener in list(engine.health_listeners):  # as the distributed engine reports a worker outage
                listener(False)
            assert wait_for(lambda: c.health() == "NOT_SERVING")
            assert rpc_error(lambda: c.generate(token_ids=[1, 2], max_tokens=2)).code() == grpc.StatusCode.UNAVAILABLE
            for listener in list(engine.health_listeners):
                listener(True)
            assert wait_for(lambda: c.health() == "SERVING")
        _, models = _http(f"http://{front.http_address}/v1/models")
        assert [m["id"] for m in models["data"]] == [Path(str(cfg.model.path)).name]
    finally:
        front.stop()
    assert front._proc.exitcode == 0 and not lost.is_set()
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_front_ends_that_die_are_reported_and_a_taken_port_is_refused(tiny: tuple[Path, Path]) -> None:
    cfg = _config(*tiny)
    engine = LLMEngine.from_config(cfg)
    lost = threading.Event()
    front = FrontEndProcess(engine, cfg, on_lost=lost.set)
    try:
        port = int(front.address.rsplit(":", 1)[1])
        taken = cfg.model_copy(update={"server": cfg.server.model_copy(update={"port": port})})
        children = _spawned(os.getpid())
        with pytest.raises((RuntimeError, OSError, MTPServeError)):
            FrontEndProcess(LLMEngine.from_config(taken), taken, on_lost=lost.set)
        assert _spawned(os.getpid()) == children, "the child that could not bind is gone"
        assert front.pid is not None
        os.kill(front.pid, signal.SIGKILL)
        assert lost.wait(15), "the engine side did not notice its front ends died"
    finally:
        front.stop()
    assert front.pid not in _spawned(os.getpid())


def _spawned(pid: int) -> set[int]:
    return {p for p in process_tree(pid)[1:] if b"spawn_main" in _cmdline(p) and not _gone(p)}


def test_an_abort_that_crosses_the_finish_keeps_the_finish(tiny: tuple[Path, Path]) -> None:
    """The request finishes in the engine while its abort is on the way: the stream ends with its own finish and
    tokens, as with the engine on a thread. Both sides are driven by hand, so the crossing always happens."""
    cfg = _config(*tiny)
    engine = LLMEngine.from_config(cfg)
    engine_end, server_end = Pipe()
    piped = PipedEngine(engine, engine_end)
    ready = threading.Thread(target=send_ready, args=(engine, engine_end))  # larger than the pipe holds
    ready.start()
    loop = asyncio.new_event_loop()
    proc = EngineProcess(cfg, loop, pipe=server_end)
    ready.join()
    proc.start()
    try:
        fut = proc.submit_nowait([5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
        assert piped._apply_commands(block=True)  # the add
        loop.run_until_complete(asyncio.sleep(0.2))  # the server reads ADDED
        handle = fut.result(5)
        piped._step()  # the request finishes; its output waits in the pipe
        assert proc.abort(handle.request_id)
        assert piped._apply_commands(block=True)  # the abort finds nothing left to stop
        loop.run_until_complete(asyncio.sleep(0.2))
        last = handle.events[-1]
        assert isinstance(last, RequestOutput) and last.finish_reason == "length" and len(last.new_token_ids) == 1
        assert proc.snapshot.kv_blocks_used == 0
    finally:
        proc.stop(timeout=0.5)
        loop.close()


def test_warm_up_leaves_nothing_held_cached_or_counted() -> None:
    """`warm_up` runs a burst of prompts, a prompt beside decode rows and a sampled request, then leaves every
    block free, nothing cached, the totals and prefix-cache counters at zero; later requests decode as on a fresh
    engine."""
    from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine

    args, w = mimic_target(seed=4)
    head = mimic_head(args, w)
    sched = {"chunk_size": 64, "max_num_batched_tokens": 256, "max_num_requests": 8}
    warmed = tiny_engine(args, w, head, scheduler=sched)
    chunks: list[tuple[int, int]] = []  # (prompt chunks, decode rows) of every step
    schedule = warmed.scheduler.schedule

    def spy(hold: bool = False) -> Any:
        plan = schedule(hold)
        ctx = sum(s.is_context for s in plan.seqs)
        chunks.append((ctx, len(plan.seqs) - ctx))
        return plan

    warmed.scheduler.schedule = spy  # type: ignore[method-assign]
    warmed.warm_up(prompt_len=40)
    warmed.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert max(c for c, _ in chunks) >= 6  # a burst of prompts in one step
    assert any(c and g for c, g in chunks)  # prompts beside decode rows
    blocks = warmed.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.num_cached == 0
    assert warmed.totals.drafted == 0 and warmed.totals.accepted == 0
    assert warmed.scheduler.prefix_query_tokens == 0 and warmed.scheduler.prefix_hit_tokens == 0
    prompts = random_prompts(3, args.vocab_size, [9, 30, 17], seed=8)
    fresh = tiny_engine(args, w, head, scheduler=sched)
    want = [c.token_ids for c in fresh.generate(prompts, {"max_tokens": 10})]
    assert [c.token_ids for c in warmed.generate(prompts, {"max_tokens": 10})] == want
