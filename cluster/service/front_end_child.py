"""A front-end process: gRPC, HTTP and metrics served over a pipe to an engine in another process (the Ray
scheduler actor's), or over Unix sockets to the engines of a FrontEndPool. It imports no part of the model
stack: what it serves comes from the engine as plain messages (child_link.py)."""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection
from typing import Any

from mtpserve.cluster.service.child_link import ERROR, portable, serve_as_child
from mtpserve.cluster.service.pool_engines import EngineSlots
from mtpserve.cluster.service.replica_set import ReplicaSet
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.heap import freeze_startup_heap

log = logging.getLogger(__name__)
SERVING, STOP_SERVING = "serving", "stop-serving"
ROUTES = "routes"  # prompts' block keys and the replicas they went to, between front ends through the pool
GROW, DRAIN = "grow", "drain"  # from the pool: connect to the engine of a slot; send a slot no new requests
DRAINED = "drained"  # to the pool: nothing of this front end is in flight on a draining slot any more
SHARE_EVERY_S = 0.02  # how often a front end sends the routes it made since the last time


def run_front_ends(
    cfg: MTPServeConfig,
    engine_pipe: Connection | EngineSlots,
    control: Connection,
    parent_pid: int,
    log_level: int,
    tag: str = "front ends",
) -> None:
    """Entry point of a front-end process: serve over `engine_pipe` until told to stop on `control` (or until
    the parent or the engine is gone); the bound endpoints, or the error, go back on `control`.

    Given Unix socket paths and keys instead of a pipe, it is one of several front ends of a FrontEndPool: it
    connects to the engine listening at each (several: replicas), shares the configured ports with the others and
    serves no metrics port (the pool serves one view of all)."""
    serve_as_child(parent_pid, log_level, tag)
    try:
        if isinstance(engine_pipe, EngineSlots):
            server = MTPServer(None, cfg, metrics=False, engines=engine_pipe, engine_metrics=False, reuse_port=True)
        else:
            server = MTPServer(None, cfg, engine_pipe=engine_pipe)
        server.start()
        freeze_startup_heap(tag)
    except BaseException as exc:
        control.send((ERROR, portable(exc)))
        return
    control.send((SERVING, server.address, server.metrics_port, server.http_address, server.port, server.http_port))
    outbox = RouteOutbox(control)
    replicas = server.loop if isinstance(server.loop, ReplicaSet) else None
    if replicas is not None:
        replicas.on_route = outbox.add
        replicas.on_drained = lambda slot: outbox.send((DRAINED, slot))
        threading.Thread(target=outbox.run, name="mtpserve-route-share", daemon=True).start()
    try:
        while server.loop.running:
            if not control.poll(0.5):
                continue
            msg = control.recv()
            if msg[0] not in (ROUTES, GROW, DRAIN):
                break  # STOP_SERVING
            if replicas is not None:
                _follow_pool(replicas, msg)
    except (EOFError, OSError):
        pass
    finally:
        outbox.stopped.set()
        server.stop(grace=cfg.server.drain_timeout_s)


def _follow_pool(replicas: ReplicaSet, msg: tuple[Any, ...]) -> None:
    """Do what a pool's message asks of this front end's replica set."""
    if msg[0] == ROUTES:
        replicas.learn(msg[1])
    elif msg[0] == GROW:
        replicas.grow(msg[1])
    else:
        replicas.drain(msg[1])


class RouteOutbox:
    """The routes a front end's replica set made, sent on its control pipe every SHARE_EVERY_S in one message (the
    pool hands them to the other front ends, whose routers then know which replica caches those prefixes), and
    whatever else the front end tells the pool (`send`)."""

    def __init__(self, control: Connection) -> None:
        self._control = control
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._routes: list[tuple[list[bytes], int]] = []
        self.stopped = threading.Event()

    def add(self, keys: list[bytes], replica: int) -> None:
        """A prompt's block keys went to `replica`."""
        with self._lock:
            self._routes.append((keys, replica))

    def send(self, msg: tuple[Any, ...]) -> bool:
        """Send one message on the control pipe (the only sender there); False once the pipe is closed."""
        with self._send_lock:
            try:
                self._control.send(msg)
            except OSError:
                return False
        return True

    def run(self) -> None:
        """Send what was added, in batches, until stopped or the pipe closes."""
        while not self.stopped.wait(SHARE_EVERY_S):
            with self._lock:
                routes, self._routes = self._routes, []
            if routes and not self.send((ROUTES, routes)):
                return
