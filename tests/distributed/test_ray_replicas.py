"""`serve --replicas 2` through Ray: two scheduler actors, each with its own worker actors in its own placement
group, behind the front-end processes of the serving process (`start_replica_actors` + `FrontEndPool(listening=)`,
what `serve_ray_replicas` runs). Shown on a local Ray cluster: chats routed by cached prefix with one engine's
answers, a replica's actor killed under load and restarted by Ray, and the command line end to end."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.front_end_pool import FrontEndPool
from mtpserve.cluster.service.pool_engines import engine_addresses
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.replicas import grows_and_shrinks, pool_chats, serves_again
from tests.helpers.service import ServeProcess, stream_all, wait_for
from tests.helpers.tiny import save_mimic

pytestmark = pytest.mark.slow

VOCAB = 96  # the mimic model's


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(model dir, head file) of the mimic model."""
    return save_mimic(tmp_path_factory.mktemp("mimic"))


def _config(model: tuple[str, str], replicas: int, distributed: bool = True) -> MTPServeConfig:
    return MTPServeConfig.from_dict(
        {
            "model": {"path": model[0], "device": "cpu", "dtype": "float32"},
            "scheduler": {"num_kv_blocks": 256, "block_size": 8, "max_num_requests": 8},
            "speculative": {"draft": model[1], "num_draft_tokens": 3},
            "parallel": {"tp_size": 1, "draft_placement": "colocated", "distributed": distributed},
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "replicas": replicas, "frontends": 2},
        }
    )


@contextlib.contextmanager
def _ray_pool(
    cfg: MTPServeConfig, spawn: Callable[[tuple[str, bytes]], Any] | None = None
) -> Iterator[tuple[list[Any], FrontEndPool]]:
    """`cfg.server.replicas` replica actors and a pool of two front ends over them (growing through `spawn`);
    everything stopped afterwards."""
    from mtpserve.cluster.distributed.scheduler_actor import start_replica_actors, stop_scheduler_actor

    folder = tempfile.mkdtemp(prefix="mtpserve-test-")
    addresses = engine_addresses(folder, cfg.server.replicas, stem="replica")
    actors = start_replica_actors(cfg, addresses)
    try:
        pool = FrontEndPool(cfg, 2, listening=addresses, spawn=spawn)
        try:
            yield actors, pool
        finally:
            pool.stop(timeout=10.0)
    finally:
        for actor in actors:
            stop_scheduler_actor(actor)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def ray_replicas(ray_local: Any, model: tuple[str, str]) -> Iterator[tuple[list[Any], FrontEndPool]]:
    """Two replica actors and a pool of two front ends over them; stopped after the test."""
    with _ray_pool(_config(model, 2)) as pair:
        yield pair


def test_ray_replicas_route_by_prefix_and_answer_like_one_engine(
    ray_replicas: tuple[list[Any], FrontEndPool], model: tuple[str, str]
) -> None:
    """Chats over two Ray replicas (each prompt on a new connection, either front end) serve >= 90% of the cached
    prompt tokens one local engine serves, both replicas take requests, and the answers are that engine's."""
    actors, pool = ray_replicas
    assert len(actors) == 2 and len(pool.loads) == 2
    answers, hits = pool_chats(pool, VOCAB)
    assert all(load.steps > 0 for load in pool.loads), pool.loads
    one = FrontEndPool(_config(model, 1, distributed=False), 2)
    try:
        one_answers, one_hits = pool_chats(one, VOCAB)
    finally:
        one.stop(timeout=10.0)
    print(f"\nprefix-cache hit tokens: one local engine {one_hits}, two Ray replicas {hits}")
    assert one_hits > 0 and hits >= 0.9 * one_hits, (one_hits, hits)
    assert answers == one_answers


def test_a_killed_replica_actor_is_restarted_by_ray_and_served_again(
    ray_replicas: tuple[list[Any], FrontEndPool], ray_local: Any
) -> None:
    """Under 32 streams (two replicas of 8 slots: some wait), one replica's scheduler actor is killed: its streams,
    running or waiting, end UNAVAILABLE within 5 s, the others complete, new requests succeed while it is down, Ray
    restarts it at the same socket, and both front ends route to it again."""
    actors, pool = ray_replicas
    errors: list[Any] = []
    done: list[int] = []
    threads = stream_all(pool.address, 32, 120, errors, done, base=20)
    try:  # both replicas hold streams (the pool hears each engine's state every 0.1 s)
        wait_for(lambda: min(load.running for load in pool.loads) > 0, 120)
    except TimeoutError:
        pytest.fail(f"not both replicas running: loads {pool.loads}, errors {errors}, done {done}")
    t_kill = time.monotonic()
    ray_local.kill(actors[0], no_restart=False)
    for t in threads:
        t.join(120)
    assert errors and done, (errors, done)
    assert all(code == grpc.StatusCode.UNAVAILABLE and t - t_kill < 5.0 for t, code in errors), errors
    assert len(errors) + len(done) == 32 and all(n == 120 for n in done)
    with MTPServeClient(pool.address) as client:
        for i in range(4):  # while Ray restarts the actor
            assert len(client.generate(token_ids=[7, 8, 9, i], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
    assert wait_for(lambda: pool.engines_built == 1, 180)
    assert serves_again(pool, 0, timeout=120)


def test_serve_replicas_through_ray_from_the_command_line(model: tuple[str, str], tmp_path: Path) -> None:
    """`mtpserve serve --distributed --replicas 2 --frontends 2` serves greedy tokens equal to one local engine's."""
    cfg = _config(model, 2)
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.model_dump_json())
    with ServeProcess(["--config", str(path)], startup_timeout=180) as srv, MTPServeClient(srv.address) as client:
        got = client.generate(token_ids=[5, 6, 7, 8], max_tokens=8, ignore_eos=True)["token_ids"]
    one = FrontEndPool(_config(model, 1, distributed=False), 1)
    try:
        with MTPServeClient(one.address) as client:
            assert got == client.generate(token_ids=[5, 6, 7, 8], max_tokens=8, ignore_eos=True)["token_ids"]
    finally:
        one.stop(timeout=10.0)


def test_ray_replicas_grow_under_pressure_and_shrink_without_cutting_a_stream(
    ray_local: Any, model: tuple[str, str]
) -> None:
    """`serve --distributed --replicas 1 --max-replicas 2 --frontends 2`: the pool starts a second replica actor
    under queue pressure, both front ends route to it, and once idle it drains it and stops the actor; no stream is
    cut (tests.helpers.replicas.grows_and_shrinks)."""
    from mtpserve.cluster.distributed.scheduler_actor import ReplicaActorEngine

    cfg = _config(model, 1)
    server = {"max_replicas": 2, "scale_up_waiting": 2, "scale_hold_s": 0.5}
    cfg = cfg.model_copy(
        update={
            "server": cfg.server.model_copy(update=server),
            "scheduler": cfg.scheduler.model_copy(update={"max_num_requests": 2}),
        }
    )
    spawned: list[ReplicaActorEngine] = []

    def spawn(address: tuple[str, bytes]) -> ReplicaActorEngine:
        spawned.append(ReplicaActorEngine.spawner(cfg)(address))
        return spawned[-1]

    with _ray_pool(cfg, spawn) as (_, pool):
        grows_and_shrinks(pool)
    assert len(spawned) == 1
    with pytest.raises(ray_local.exceptions.RayActorError):  # the shrink stopped the added replica's actor
        ray_local.get(spawned[0].actor.ready.remote(), timeout=30)
