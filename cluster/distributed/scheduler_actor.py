"""The scheduler as a Ray actor: it owns the engine (scheduler + step loop) and its worker actors, and serves the
public gRPC (and HTTP) API from child processes (`server.engine_process`, the default): one over a pipe, or with
`server.frontends` above 1 several on the same ports (FrontEndPool), so that the front ends' per-token work and the
scheduler's per-step work do not share one interpreter lock; with `server.engine_process: false` it serves them
from its own process."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from mtpserve.cluster.service.actor_front_ends import FrontEndProcess
from mtpserve.cluster.service.engine_child import EngineThread
from mtpserve.cluster.service.front_end_pool import FrontEndPool
from mtpserve.cluster.service.pool_engines import ListeningEngine
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.heap import freeze_startup_heap

log = logging.getLogger(__name__)
RESTARTS = 3  # Ray restarts a crashed scheduler actor this often; it rebuilds its workers and rebinds its port


class SchedulerActor:
    """Runs on a CPU of the driver's node; creates the TP target and draft worker actors itself."""

    def __init__(self, cfg_json: str, listen: tuple[str, bytes] | None = None) -> None:
        import ray

        from mtpserve.cluster.distributed.actors import build_distributed_engine

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.cfg = MTPServeConfig.model_validate_json(cfg_json)
        workers = f"mtpserve-workers-{ray.get_runtime_context().get_actor_id()}"  # the same after a restart
        self.engine = build_distributed_engine(self.cfg, workers)
        self._stopping = False
        self.server: MTPServer | FrontEndProcess | FrontEndPool | EngineThread
        if listen is not None:  # one replica: the driver's front ends connect to its engine at `listen`
            self.server = EngineThread(self.engine, listen, drained=True)
        elif self.cfg.server.engine_process and self.cfg.server.num_frontends > 1:
            self.server = FrontEndPool(
                self.cfg, self.cfg.server.num_frontends, local_engine=lambda address: EngineThread(self.engine, address)
            )
        elif self.cfg.server.engine_process:
            self.server = FrontEndProcess(self.engine, self.cfg, on_lost=self._front_ends_lost)
        else:
            self.server = MTPServer(self.engine, self.cfg)
            self.server.start()
        freeze_startup_heap("scheduler actor")

    def endpoints(self) -> tuple[str, int | None, str | None]:
        """(gRPC host:port, metrics port, HTTP host:port or None)."""
        assert not isinstance(self.server, EngineThread), "a replica's actor serves no endpoint of its own"
        return self.server.address, self.server.metrics_port, self.server.http_address

    def ready(self) -> bool:
        """Liveness probe for Ray."""
        return True

    def pids(self) -> tuple[int, int | None]:
        """(this actor's process id, the (first) front-end process's id or None when the front ends run here)."""
        srv = self.server
        if isinstance(srv, FrontEndPool):
            return os.getpid(), srv.pids[0]
        if isinstance(srv, EngineThread):
            return os.getpid(), None
        return os.getpid(), None if isinstance(srv, MTPServer) else srv.pid

    def worker_pids(self) -> list[int]:
        """Process ids of the worker actors: the target ranks in order, then a separate draft worker."""
        import ray

        group = self.engine.target.group  # type: ignore[attr-defined]
        return list(ray.get([a.ready.remote() for a in group.actors]))

    def stop(self) -> None:
        """Stop serving and release the worker actors."""
        self._stopping = True
        self.server.stop()
        self.engine.shutdown()

    def _front_ends_lost(self) -> None:
        """The front-end process died: start new front ends for the same engine and workers; if they cannot
        start, end this process so that Ray restarts the whole actor."""
        if self._stopping:
            return
        log.error("the front-end process died; starting new front ends")
        try:
            self.server = FrontEndProcess(self.engine, self.cfg, on_lost=self._front_ends_lost)
        except Exception:
            log.exception("new front ends could not start; restarting the scheduler actor")
            os._exit(1)


def start_scheduler_actor(cfg: MTPServeConfig) -> tuple[Any, str, int | None, str | None]:
    """Start the scheduler actor pinned to this node; returns (handle, gRPC address, metrics port, HTTP address).

    If its process dies, Ray starts it again (up to RESTARTS times): it builds new workers and serves the
    same server.port again, so clients reconnect to the same address (with port 0 the new port differs)."""
    import ray

    from mtpserve.cluster.distributed.actors import connect_ray

    connect_ray(cfg.parallel.ray_address)
    actor_cls = ray.remote(SchedulerActor)
    actor: Any = actor_cls.options(**_pinned_here()).remote(cfg.model_dump_json())  # type: ignore[attr-defined]
    address, metrics_port, http_address = ray.get(actor.endpoints.remote(), timeout=900)
    return actor, address, metrics_port, http_address


def start_replica_actors(cfg: MTPServeConfig, addresses: Sequence[tuple[str, bytes]]) -> list[Any]:
    """One scheduler actor per replica, pinned to this node, each building its engine and workers (its own
    placement group) at once and serving it at one of `addresses` for the front ends of this process to connect
    to; raises what a build raised (after stopping the others). Ray restarts a crashed one, which listens again at
    the same socket."""
    import ray

    from mtpserve.cluster.distributed.actors import connect_ray

    connect_ray(cfg.parallel.ray_address)
    actor_cls: Any = ray.remote(SchedulerActor)
    options = _pinned_here()
    actors = [actor_cls.options(**options).remote(cfg.model_dump_json(), address) for address in addresses]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=900)
    except BaseException:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        raise
    return actors


class ReplicaActorEngine:
    """A replica's scheduler actor that a FrontEndPool adds at run time (`server.max_replicas`), as one of its
    engines: the pool hears it as a ListeningEngine, and `close` stops the actor with its workers."""

    def __init__(self, address: tuple[str, bytes], actor: Any) -> None:
        self.address, self.actor = address, actor
        self._listening = ListeningEngine(address)
        self.control = self._listening.control

    @classmethod
    def spawner(cls, cfg: MTPServeConfig) -> Callable[[tuple[str, bytes]], ReplicaActorEngine]:
        """What builds one more replica actor for the pool, serving at the address given."""
        return lambda address: cls(address, start_replica_actors(cfg, [address])[0])

    pid = None  # the actor's process is Ray's to know

    def status(self) -> str:
        """How it ended, for errors and logs."""
        return self._listening.status()

    def join(self, timeout: float) -> None:
        """Nothing to wait for: `close` stops it."""

    def again(self) -> ReplicaActorEngine:
        """A connection to the same actor once Ray has started it again after a crash (it listens where it did)."""
        return ReplicaActorEngine(self.address, self.actor)

    def close(self) -> None:
        """Stop the actor and its workers (nothing if it is gone already)."""
        with contextlib.suppress(Exception):
            stop_scheduler_actor(self.actor)


def stop_scheduler_actor(actor: Any) -> None:
    """Shut the actor (and through it the workers) down."""
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)


def _pinned_here() -> dict[str, Any]:
    """Ray options of a scheduler actor: no CPU of its own, restarted on a crash, on this node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return {
        "name": None,
        "num_cpus": 0,
        "max_restarts": RESTARTS,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    }
