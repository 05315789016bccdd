"""The asyncio side of the engine loop (cluster/service/engine_stream.py, cluster/service/health.py): a stream that
falls behind gets the tokens it missed in one piece, an error after tokens comes after them, one wake-up per
burst of events, and grpc.health.v1 Watch follows the server's state."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtpserve.cluster.engine.chat_encoding import encode_text
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.engine_stream import EngineStream, LoopWaker, merged
from mtpserve.cluster.service.metrics import GRPC
from mtpserve.cluster.service.request_book import EngineFailure, RequestHandle
from mtpserve.cluster.service.server import MTPServer
from tests.helpers.service import dummy_server_config, wait_for, write_dummy_model, write_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MTPServer]:
    """An MTPServer in this process on a dummy-weight model, speculative (K=2), port 0, metrics off."""
    model: Path = write_dummy_model(tmp_path_factory.mktemp("dummy"))
    srv = MTPServer(LLMEngine.from_config(dummy_server_config(model, num_draft_tokens=2)), metrics=False)
    srv.start()
    yield srv
    srv.stop()


def _read(server: MTPServer, prompt: list[int], tokens: int, wait_done: bool) -> list[list[int]]:
    """The token ids of each piece of one greedy request, read on the front-end loop; with `wait_done` the
    reader starts only once the engine has finished the request."""

    async def run() -> list[list[int]]:
        stream = EngineStream(server.loop, None, [], GRPC)
        done_before = server.loop.snapshot.requests_finished
        await stream.start(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), None)
        try:
            while wait_done and server.loop.snapshot.requests_finished == done_before:
                await asyncio.sleep(0.01)
            return [piece.token_ids async for piece in stream.pieces()]
        finally:
            stream.close()

    return server.front_end.call(run, timeout=60)


def test_a_stream_that_falls_behind_gets_the_missed_tokens_in_one_piece(server: MTPServer) -> None:
    prompt = [5, 9, 13, 17]
    live = _read(server, prompt, 12, wait_done=False)
    late = _read(server, prompt, 12, wait_done=True)
    assert len(late) == 1 and len(late[0]) == 12
    assert [t for piece in live for t in piece] == late[0]  # the same tokens, in order (greedy)
    assert server.loop.snapshot.kv_blocks_used == 0


def test_an_error_after_tokens_reaches_the_reader_after_them(server: MTPServer) -> None:
    async def run() -> tuple[list[list[int]], BaseException | None]:
        stream = EngineStream(server.loop, None, [], GRPC)
        stream.handle = handle = RequestHandle("r", 3)
        for ids in ([1], [2, 3], [4]):
            handle.put(RequestOutput("r", ids, False, None, num_prompt_tokens=3, num_output_tokens=0))
        handle.put(EngineFailure("boom"))
        got: list[list[int]] = []
        try:
            async for piece in stream.pieces():
                got.append(piece.token_ids)
        except EngineFailure as exc:
            return got, exc
        return got, None

    got, err = server.front_end.call(run)
    assert got == [[1, 2, 3, 4]] and isinstance(err, EngineFailure)


def test_merged_keeps_the_later_state() -> None:
    a = RequestOutput("r", [1, 2], False, None, num_prompt_tokens=5, num_output_tokens=2)
    b = RequestOutput("r", [3], True, "length", num_prompt_tokens=5, num_output_tokens=3)
    assert merged(a, b) == RequestOutput("r", [1, 2, 3], True, "length", num_prompt_tokens=5, num_output_tokens=3)
    assert a.new_token_ids == [1, 2]


def test_events_set_in_a_burst_from_another_thread_all_wake() -> None:
    async def run() -> tuple[int, int]:
        waker = LoopWaker.of_running_loop()
        assert LoopWaker.of_running_loop() is waker
        events = [asyncio.Event() for _ in range(64)]
        loop = asyncio.get_running_loop()
        calls = 0
        real = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        try:

            def burst() -> None:
                for e in events:
                    waker.wake(e)

            await asyncio.to_thread(burst)
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)
        finally:
            del loop.call_soon_threadsafe
        return sum(e.is_set() for e in events), calls

    woken, calls = asyncio.run(run())
    assert woken == 64 and 1 <= calls < 64


def test_health_watch_follows_the_serving_state(server: MTPServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="mtpserve.v1.Inference"), timeout=30)
        seen = [next(watch).status]
        server.set_serving(False)
        try:
            seen.append(next(watch).status)
        finally:
            server.set_serving(True)
        seen.append(next(watch).status)
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        first_unknown = next(unknown).status
        unknown.cancel()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen == [serving, not_serving, serving]
    assert first_unknown == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    assert wait_for(lambda: server.is_serving(), 5)


def test_prompts_encode_at_once_and_text_does_not_wait_on_them(tmp_path: Path) -> None:
    """Each worker thread encodes with its own tokenizer copy and streams decode with the front end's: text prompts
    over gRPC are served while another thread encodes long prompts without pause, and every encode equals the
    tokenizer's own."""
    model, head = write_tiny_model(tmp_path)
    cfg = dummy_server_config(model)
    cfg.model.load_format = "auto"
    cfg.speculative.draft = str(head)
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=False)
    srv.start()
    try:
        tokenizers = srv.servicer.tokenizers
        assert tokenizers.decoder is not tokenizers.encoder
        long_text = "the quick brown fox jumps over the lazy dog, " * 40
        want = encode_text(tokenizers.encoder, long_text, False)
        done = threading.Event()
        encodes: list[bool] = []

        def encode_all_along() -> None:
            while not done.is_set():
                encodes.append(tokenizers.submit(encode_text, long_text, False).result() == want)

        busy = threading.Thread(target=encode_all_along)
        busy.start()
        try:
            with MTPServeClient(f"127.0.0.1:{srv.port}", timeout=30) as client:
                outs = [client.generate(f"Tell me about {w}", max_tokens=8, ignore_eos=True) for w in "abcd"]
        finally:
            done.set()
            busy.join(30)
        assert len(encodes) >= 4 and all(encodes)
        for out in outs:
            assert len(out["token_ids"]) == 8
            assert out["text"] == tokenizers.encoder.decode(out["token_ids"], skip_special_tokens=True)
    finally:
        srv.stop()


def test_stop_ends_health_watches_within_the_grace(tmp_path: Path) -> None:
    srv = MTPServer(LLMEngine.from_config(dummy_server_config(write_dummy_model(tmp_path))), metrics=False)
    srv.start()
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as chan:
        watch = health_pb2_grpc.HealthStub(chan).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        t0 = time.monotonic()
        srv.stop(grace=5.0)
        stopped_in = time.monotonic() - t0
        rest = [m.status for m in watch]
    assert rest == [health_pb2.HealthCheckResponse.NOT_SERVING]
    assert stopped_in < 5.0, "an open Watch must not hold the server for the whole grace"
