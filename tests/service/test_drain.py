"""SIGTERM drains `mtpserve serve`: health turns NOT_SERVING, the streams in flight finish within
server.drain_timeout_s, and those that cannot end with a terminal status (gRPC UNAVAILABLE; over HTTP an `abort`
finish, an error event and [DONE]), never cut silently."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml

from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers.service import ServeProcess, write_tiny_model

STREAMS = 16  # per API: 32 in flight at SIGTERM
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head) of a tiny model with SmolLM2's tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def start(tiny: tuple[Path, Path], tmp: Path, drain_s: float) -> ServeProcess:
    cfg = {
        "model": {"device": "cpu", "dtype": "float32"},
        "scheduler": {"max_num_requests": 32, "num_kv_blocks": 1200, "block_size": 16},
        "server": {"drain_timeout_s": drain_s},
    }
    (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
    model, head = tiny
    args = ["--config", str(tmp / "serve.yaml"), "--model", str(model), "--draft", str(head), "--http-port", "0"]
    return ServeProcess(args).start()


class Started:
    """Counts the streams that have received their first chunk; `all` is set once `n` have."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.all = n, set(), asyncio.Event()

    def add(self, i: int, out: dict[str, Any]) -> None:
        """Note that stream `out` (number `i`) has received a chunk."""
        self.seen.add(id(out))
        if len(self.seen) >= self.n:
            self.all.set()


async def http_stream(base: str, model: str, i: int, max_tokens: int, started: Started) -> dict[str, Any]:
    """One streamed completion: its tokens, the finish reasons it saw, and how it ended."""
    out: dict[str, Any] = {"tokens": 0, "finishes": [], "end": "complete"}
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
        try:
            stream: Any = await client.completions.create(
                model=model,
                prompt=[20 + i, 21, 22],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    out["tokens"] += len(choice.token_ids or [])
                    if choice.finish_reason:
                        out["finishes"].append(choice.finish_reason)
                started.add(i, out)
        except openai.APIError as exc:  # an error event in the stream: a terminal status
            out["end"] = f"error event: {exc.message}"
        except Exception as exc:  # a connection cut without a terminal status
            out["end"] = f"cut: {type(exc).__name__}: {exc}"
    return out


async def grpc_stream(address: str, i: int, max_tokens: int, started: Started) -> dict[str, Any]:
    """One Generate stream: its tokens, its finish reason, and its status."""
    out: dict[str, Any] = {"tokens": 0, "finishes": [], "end": "complete"}
    async with grpc.aio.insecure_channel(address) as channel:
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[40 + i, 41, 42]),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        try:
            async for msg in pb_grpc.InferenceStub(channel).Generate(req, timeout=120):
                out["tokens"] += len(msg.token_ids)
                if msg.finish_reason:
                    out["finishes"].append(pb.FinishReason.Name(msg.finish_reason))
                started.add(i, out)
        except grpc.aio.AioRpcError as exc:
            out["end"] = f"status {exc.code().name}: {exc.details()}"
    return out


def run_and_terminate(srv: ServeProcess, max_tokens: int) -> tuple[list[dict[str, Any]], int | None]:
    """STREAMS streams over each API; SIGTERM once tokens flow; their outcomes and the server's exit code."""

    async def run() -> tuple[list[dict[str, Any]], int | None]:
        started = Started(2 * STREAMS)
        base = f"{srv.http_url}/v1"
        model = (await asyncio.to_thread(openai.OpenAI(base_url=base, api_key="unused").models.list)).data[0].id
        tasks = [asyncio.create_task(http_stream(base, model, i, max_tokens, started)) for i in range(STREAMS)]
        tasks += [asyncio.create_task(grpc_stream(srv.address, i, max_tokens, started)) for i in range(STREAMS)]
        await asyncio.wait_for(started.all.wait(), 60)  # every stream under way: none is refused as new
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
        code = await asyncio.to_thread(srv.proc.wait, 60)
        return list(outcomes), code

    return asyncio.run(run())


def test_sigterm_lets_the_streams_in_flight_finish(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    srv = start(tiny, tmp_path, drain_s=60.0)
    try:
        outcomes, code = run_and_terminate(srv, max_tokens=48)
    finally:
        srv.stop()
    assert code == 0, srv.log
    wrong = [o for o in outcomes if o["end"] != "complete" or o["tokens"] != 48]
    assert not wrong, wrong
    assert all(o["finishes"] in (["length"], ["FINISH_REASON_LENGTH"]) for o in outcomes), outcomes


def test_sigterm_ends_what_outlasts_the_drain_with_a_terminal_status(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    srv = start(tiny, tmp_path, drain_s=1.0)
    try:
        outcomes, code = run_and_terminate(srv, max_tokens=480)
    finally:
        srv.stop()
    assert code == 0, srv.log
    cut = [o for o in outcomes if o["end"].startswith("cut")]
    assert not cut, cut  # every stream that did not finish ended with a status
    ended = [o for o in outcomes if o["end"] != "complete"]
    assert ended, outcomes  # 480 tokens each outlast a 1 s drain
    for o in ended:
        assert o["end"].startswith(("error event", "status UNAVAILABLE")), o
        if o["end"].startswith("error event"):
            assert o["finishes"] == ["abort"], o
