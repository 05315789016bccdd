"""`serve --replicas 2 --frontends 2`: every front-end process routes over every engine replica (`FrontEndPool`
with replicas). Shown here: a chat's later turns find their prefix whichever front end takes them (the front ends
tell one another their routes), answers equal to one engine's, and a replica's engine killed under load while the
other serves, then built again and connected to by every front end."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.front_end_pool import FrontEndPool
from tests.helpers.replicas import pool_chats, replica_config, serves_again
from tests.helpers.service import stream_all, wait_for, write_tiny_model

pytestmark = pytest.mark.slow

FRONT_ENDS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head) of a tiny model with SmolLM2's tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_later_turns_find_their_prefix_through_any_front_end(tiny: tuple[Path, Path]) -> None:
    """Two front ends over two prefix-routed replicas serve >= 90% of the cached prompt tokens that two front ends
    over one engine serve; the answers are one engine's, token for token. (Round-robin is printed, not bounded:
    each front end keeps its own turn, so where a chat's turns land depends on which front end the kernel gives
    each connection; one front end's round-robin is bounded in test_replicas.py.)"""
    results: dict[str, tuple[list[list[int]], int]] = {}
    for name, replicas, routing in (("one", 1, "prefix"), ("prefix", 2, "prefix"), ("round_robin", 2, "round_robin")):
        pool = FrontEndPool(replica_config(*tiny, replicas, routing, frontends=FRONT_ENDS), FRONT_ENDS)
        try:
            assert len(pool.engine_pids) == replicas and len(pool.pids) == FRONT_ENDS
            results[name] = pool_chats(pool, vocab=2048)
            if replicas > 1:
                assert all(load.steps > 0 for load in pool.loads), pool.loads  # both replicas served
            if name == "prefix":
                assert pool.routes_relayed > 0, "front ends share their routes"
            else:  # one engine slot, or no prefix routing: routes decide nothing, so none are shared
                assert pool.routes_relayed == 0, name
        finally:
            pool.stop(timeout=10.0)
    one, prefix, rr = results["one"][1], results["prefix"][1], results["round_robin"][1]
    print(
        f"\nprefix-cache hit tokens over {FRONT_ENDS} front ends: one engine {one}, two replicas by prefix {prefix}, "
        f"two round-robin {rr}"
    )
    assert one > 0
    assert prefix >= 0.9 * one, (one, prefix)
    assert rr < one, (one, rr)
    assert results["prefix"][0] == results["one"][0] == results["round_robin"][0]


def test_a_killed_replica_is_built_again_and_every_front_end_serves_it(tiny: tuple[Path, Path]) -> None:
    """Under 16 streams over two front ends and two replicas, one replica's engine process is killed: its streams
    end UNAVAILABLE within 5 s, the others complete, new requests succeed while it is down, the pool builds it
    again at the same socket, and requests reach it again."""
    pool = FrontEndPool(replica_config(*tiny, 2, frontends=FRONT_ENDS), FRONT_ENDS)
    try:
        errors: list[Any] = []
        done: list[int] = []
        threads = stream_all(pool.address, 16, 200, errors, done)
        assert wait_for(lambda: min(load.running for load in pool.loads) > 0, 30), pool.loads
        victim = pool.engine_pids[0]
        assert victim is not None
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert errors and done, (errors, done)
        assert all(code == grpc.StatusCode.UNAVAILABLE and t - t_kill < 5.0 for t, code in errors), errors
        assert len(errors) + len(done) == 16 and all(n == 200 for n in done)
        client = MTPServeClient(pool.address)
        try:
            for i in range(4):  # while the replica is built again
                assert len(client.generate(token_ids=[7, 8, 9, i], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
        finally:
            client.close()
        assert wait_for(lambda: pool.engines_built == 1, 90)
        assert pool.engine_pids[0] not in (None, victim) and pool.engine_running
        assert serves_again(pool, 0)  # each front end connected to the new engine and routes to it
    finally:
        pool.stop(timeout=10.0)
