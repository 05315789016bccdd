"""`serve --replicas N` on one node: N engine processes behind one gRPC endpoint (`ReplicaSet`), each request
routed to the replica that holds its prompt's cached prefix (`PrefixRouter`) or in turn (`round_robin`).

Measured here on multi-turn chats whose later turns repeat the earlier ones: the prefix-cache tokens two routed
replicas serve against one replica and against round-robin, greedy answers equal to one engine's, and a replica
killed under load while the other keeps serving."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.engine_process import EngineProcess
from mtpserve.cluster.service.replica_set import ReplicaSet
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.replicas import replica_config
from tests.helpers.service import stream_all, wait_for, write_tiny_model

pytestmark = pytest.mark.slow

CHATS, TURNS = 7, 4  # an odd number of chats: round-robin sends a chat's turns to alternate replicas


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head) of a tiny model with SmolLM2's tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _chats(server: MTPServer) -> tuple[list[list[int]], int]:
    """Every chat's answers, turn after turn (each turn's prompt: the last prompt, its answer and 24 new tokens),
    and the prompt tokens the engines served from their prefix caches."""
    client = MTPServeClient(server.address)
    prompts = [list(range(200 + 50 * c, 240 + 50 * c)) for c in range(CHATS)]
    answers: list[list[int]] = []
    try:
        for turn in range(TURNS):
            for c in range(CHATS):
                out = client.generate(token_ids=prompts[c], max_tokens=8, ignore_eos=True)
                answers.append(out["token_ids"])
                prompts[c] = [*prompts[c], *out["token_ids"], *range(1000 + 40 * turn + c, 1024 + 40 * turn + c)]
    finally:
        client.close()
    return answers, server.loop.snapshot.prefix_hit_tokens


def _serve(cfg: MTPServeConfig) -> MTPServer:
    srv = MTPServer(None, cfg, metrics=False)
    srv.start()
    return srv


def test_later_turns_find_their_prefix_on_the_replica_that_holds_it(tiny: tuple[Path, Path]) -> None:
    """Two prefix-routed replicas serve >= 90% of the cached prompt tokens one replica serves, round-robin over two
    clearly fewer; the answers are one engine's, token for token."""
    results: dict[str, tuple[list[list[int]], int]] = {}
    for name, replicas, routing in (("one", 1, "prefix"), ("prefix", 2, "prefix"), ("round_robin", 2, "round_robin")):
        srv = _serve(replica_config(*tiny, replicas, routing))
        try:
            if replicas > 1:
                assert isinstance(srv.loop, ReplicaSet) and len(srv.loop.replicas) == 2
            results[name] = _chats(srv)
            if isinstance(srv.loop, ReplicaSet):
                assert all(n > 0 for n in srv.loop.counts.by_replica), srv.loop.counts  # both replicas served
        finally:
            srv.stop(grace=0.0)
    one, prefix, rr = results["one"][1], results["prefix"][1], results["round_robin"][1]
    print(f"\nprefix-cache hit tokens: one replica {one}, two routed by prefix {prefix}, two round-robin {rr}")
    assert one > 0
    assert prefix >= 0.9 * one, (one, prefix)
    assert rr <= 0.75 * one, (one, rr)
    assert results["prefix"][0] == results["one"][0] == results["round_robin"][0]


def test_a_killed_replica_ends_its_streams_and_the_other_keeps_serving(tiny: tuple[Path, Path]) -> None:
    """Under 16 streams over two replicas, one replica's engine process is killed: its streams end UNAVAILABLE
    within 5 s, the other's complete, health stays SERVING, new requests succeed throughout, and the replica is
    built again and takes requests."""
    srv = _serve(replica_config(*tiny, 2))
    try:
        loop = srv.loop
        assert isinstance(loop, ReplicaSet)
        errors: list[Any] = []
        done: list[int] = []
        threads = stream_all(srv.address, 16, 200, errors, done)
        deadline = time.monotonic() + 30
        while min(r.snapshot.running for r in loop.replicas) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = loop.replicas[0]
        assert isinstance(victim, EngineProcess) and victim._proc is not None and victim._proc.pid is not None
        t_kill = time.monotonic()
        os.kill(victim._proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert errors and done, (errors, done)
        assert all(code == grpc.StatusCode.UNAVAILABLE and t - t_kill < 5.0 for t, code in errors), errors
        assert len(errors) + len(done) == 16 and all(n == 200 for n in done)
        assert srv.is_serving()
        client = MTPServeClient(srv.address)
        try:
            for i in range(4):
                out = client.generate(token_ids=[7, 8, 9, i], max_tokens=4, ignore_eos=True)
                assert len(out["token_ids"]) == 4
            assert wait_for(lambda: loop.revived == 1 and loop.replicas[0].running and 0 in loop.router.live, 90)
            assert loop.replicas[0] is not victim
            before = loop.counts.by_replica[0]
            for i in range(12):
                out = client.generate(token_ids=[17, 18, 19, i], max_tokens=4, ignore_eos=True)
                assert len(out["token_ids"]) == 4
            assert loop.counts.by_replica[0] > before, loop.counts  # the rebuilt replica serves again
        finally:
            client.close()
    finally:
        srv.stop(grace=0.0)


def test_replicas_need_engine_processes_and_take_several_front_ends() -> None:
    """More than one replica is refused without engine processes, naming the field; fixed and scaling replicas
    both take several front ends."""
    base = {"model": {"device": "cpu"}, "server": {"replicas": 2}}
    assert MTPServeConfig.from_dict(base).server.replicas == 2
    with pytest.raises(ValueError, match=r"server\.replicas > 1.*server\.engine_process"):
        MTPServeConfig.from_dict({**base, "server": {"replicas": 2, "engine_process": False}})
    assert MTPServeConfig.from_dict({**base, "server": {"replicas": 2, "frontends": 2}}).server.num_frontends == 2
    scaling = MTPServeConfig.from_dict({**base, "server": {"replicas": 2, "max_replicas": 3, "frontends": 2}})
    assert scaling.server.num_frontends == 2 and scaling.server.most_replicas == 3
