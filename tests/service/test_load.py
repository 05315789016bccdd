"""Many concurrent gRPC streams against one server on loopback: cancellations, deadlines, nothing lost."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.server import MTPServer
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from tests.helpers.service import wait_for
from tests.helpers.tiny import random_prompts, tiny_args, tiny_engine, tiny_head, tiny_weights

STREAMS = 256
ROUNDS = 3
MAX_TOKENS = 6


@dataclass
class Outcome:
    """How one stream ended: its tokens, and a final finish reason or a status code."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    code: grpc.StatusCode | None = None
    details: str = ""


@pytest.fixture(scope="module")
def server() -> Iterator[MTPServer]:
    """A speculative (K=2) tiny-model server, 32 running slots and a long queue, metrics off."""
    args = tiny_args()
    weights = tiny_weights(args)
    engine = tiny_engine(
        args,
        weights,
        tiny_head(args, weights),
        speculative={"num_draft_tokens": 2},
        scheduler={"num_kv_blocks": 512, "block_size": 8, "max_num_requests": 32, "max_queue": 1024},
        server={"port": 0, "metrics_port": 0},
    )
    srv = MTPServer(engine, metrics=False)
    srv.start()
    yield srv
    srv.stop()
    engine.shutdown()


def plan(seed: int) -> list[dict]:
    """Per stream: prompt, greedy or sampled, and whether it is cancelled or gets a tiny deadline."""
    rng = random.Random(seed)
    prompts = random_prompts(STREAMS, tiny_args().vocab_size, [3, 9, 17, 30], seed=seed)
    out = []
    for i, p in enumerate(prompts):
        fate = rng.choices(["run", "cancel", "deadline"], weights=[6, 1, 1])[0]
        greedy = i % 2 == 0
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        if not greedy:
            sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.9, i
        out.append({"prompt": p, "greedy": greedy, "fate": fate, "sampling": sampling})
    return out


def run_stream(client: MTPServeClient, spec: dict, outcome: Outcome, start: threading.Barrier) -> None:
    """One stream: wait for all to be ready, then call; cancel after the first chunk if so planned."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=spec["prompt"]), sampling=spec["sampling"])
    timeout = 0.02 if spec["fate"] == "deadline" else 120.0
    start.wait()
    call = client.stub.Generate(req, timeout=timeout)
    try:
        for msg in call:
            outcome.tokens.extend(msg.token_ids)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                outcome.finish = pb.FinishReason.Name(msg.finish_reason)
            if spec["fate"] == "cancel":
                call.cancel()
    except grpc.RpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""


def one_round(address: str, specs: list[dict]) -> list[Outcome]:
    """All streams at once, from one thread each; every thread must end."""
    outcomes = [Outcome() for _ in specs]
    start = threading.Barrier(len(specs))
    with MTPServeClient(address, timeout=120) as client:
        threads = [
            threading.Thread(target=run_stream, args=(client, s, o, start), daemon=True)
            for s, o in zip(specs, outcomes, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a stream hung"
    return outcomes


def rss_mb() -> float:
    """This process's resident memory in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_256_streams_end_cleanly_lose_nothing_and_free_every_block(server: MTPServer) -> None:
    """Three rounds of 256 concurrent streams, mixed greedy and sampled, some cancelled and some with a
    20 ms deadline. Every stream ends with a final message or CANCELLED / DEADLINE_EXCEEDED; every stream
    that ran to the end has its max_tokens tokens, and each greedy one the tokens of the same request run
    alone; every KV block is free after each round; memory and threads stay flat after the first round."""
    address = f"127.0.0.1:{server.port}"
    sched = server.engine.scheduler
    blocks = sched.blocks
    memory, threads = [], []
    for r in range(ROUNDS):
        specs = plan(seed=r)
        outcomes = one_round(address, specs)
        for spec, out in zip(specs, outcomes, strict=True):
            if out.code is None:
                assert out.finish == "FINISH_REASON_LENGTH" and len(out.tokens) == MAX_TOKENS, out
            else:
                allowed = {"cancel": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}
                assert out.code == allowed.get(spec["fate"]), (spec["fate"], out)
        finished = [(s, o) for s, o in zip(specs, outcomes, strict=True) if o.code is None]
        assert sum(1 for s, _ in finished if s["fate"] == "run") == sum(1 for s in specs if s["fate"] == "run")
        wait_for(lambda: not sched.has_unfinished() and blocks.num_free == blocks.num_blocks, timeout=30.0)
        memory.append(rss_mb())
        threads.append(sum(1 for t in threading.enumerate() if not t.name.startswith("mtpserve-grpc")))
        if r == 0:
            with MTPServeClient(address, timeout=60) as alone:
                for spec, out in finished:
                    if spec["greedy"]:
                        ids = alone.generate(token_ids=spec["prompt"], max_tokens=MAX_TOKENS, ignore_eos=True)
                        assert ids["token_ids"] == out.tokens
    assert memory[-1] - memory[1] < 64, f"resident memory grew across rounds: {memory}"
    # the server's gRPC pool keeps idle workers up to its bound; every other thread must be gone
    assert threads[-1] <= threads[0], f"threads grew across rounds: {threads}"
