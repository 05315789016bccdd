"""`mtpserve serve`: load the engine and serve the gRPC API, the OpenAI-compatible HTTP API (with --http-port)
and Prometheus metrics until signalled."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import yaml

from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.cluster.cli.config_flags import SERVER_SECTIONS, add_config_flags
from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.workers.config import MTPServeConfig

if TYPE_CHECKING:
    from mtpserve.cluster.service.pool_engines import PoolEngine

log = logging.getLogger(__name__)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Server flags plus the shared engine flags (also used by `python -m mtpserve.cluster.job`)."""
    p.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit")
    add_config_flags(p, SERVER_SECTIONS)
    add_engine_flags(p)


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    """Register the sub-command."""
    p = sub.add_parser(
        name,
        help="serve the gRPC API (and, with --http-port, the OpenAI-compatible HTTP API)",
        description="Load the target (and draft head) and serve mtpserve.v1.Inference over gRPC, with the "
        "grpc.health.v1 Health service, server reflection and Prometheus metrics, and with --http-port the "
        "OpenAI-compatible HTTP API from the same engine, until SIGINT or SIGTERM.",
    )
    add_serve_flags(p)
    p.set_defaults(func=run)


def print_config(cfg: MTPServeConfig) -> None:
    """The merged config as YAML on stdout."""
    sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def install_stop_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop`; repeats are logged and ignored (the shutdown is bounded)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.info("received %s again; already shutting down", name)
            return
        log.info("received %s; shutting down", name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def serve(cfg: MTPServeConfig, stop: threading.Event | None = None) -> int:
    """Build the engine, serve until `stop` is set (by SIGINT/SIGTERM by default), shut down cleanly; exit status 1
    when the engine stops on its own (its process died), so that a supervisor restarts the server.

    With Ray (tp_size > 1, --distributed or --address) the scheduler runs in a scheduler actor on this node, which
    starts the worker actors and the front ends' process; this process only waits.
    """
    from mtpserve.cluster.service.auth import check_server_files
    from mtpserve.cluster.service.server import MTPServer

    try:
        check_server_files(cfg.server)
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    scales = cfg.server.most_replicas > cfg.server.replicas
    if cfg.parallel.uses_ray:
        if cfg.server.replicas > 1 or scales:
            return serve_ray_replicas(cfg, stop)
        return serve_with_actor(cfg, stop)

    if cfg.server.engine_process and (cfg.server.num_frontends > 1 or scales):
        return serve_pooled(cfg, stop)
    engine, rc = None, 0
    try:
        if cfg.server.engine_process:
            server = MTPServer(None, cfg)  # the engine is built in its own process
        else:  # the engine in this process: only here does this process load the model stack
            from mtpserve.cluster.distributed.build import build_engine
            from mtpserve.workers.builders import set_cpu_threads

            set_cpu_threads(cfg)
            engine = build_engine(cfg)
            server = MTPServer(engine, cfg)
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    if stop is None:
        stop = threading.Event()
        install_stop_signals(stop)
    try:
        try:
            server.start()
        except (RuntimeError, OSError) as exc:  # a port that cannot be bound (gRPC, HTTP or metrics)
            sc = cfg.server
            ports = f"port {sc.port}, http_port {sc.http_port}, metrics_port {sc.metrics_port}"
            print(f"mtpserve: cannot serve on {sc.host} ({ports}): {exc}", file=sys.stderr)
            return 2
        print(f"mtpserve: {serving_line(server.address, server.metrics_port, server.http_address)}", flush=True)
        while not stop.wait(0.5):
            if not server.loop.running:  # the engine process died: exit, so that a supervisor restarts the server
                print("mtpserve: the engine stopped (see the log above); exiting", file=sys.stderr, flush=True)
                rc = 1
                break
    finally:
        server.stop(grace=cfg.server.drain_timeout_s)
        if engine is not None:
            engine.shutdown()
        log.info("stopped")
    print("mtpserve: stopped", flush=True)
    return rc


def serve_pooled(
    cfg: MTPServeConfig,
    stop: threading.Event | None = None,
    listening: Sequence[tuple[str, bytes]] = (),
    spawn: Callable[[tuple[str, bytes]], PoolEngine] | None = None,
) -> int:
    """`serve` with several front-end processes (FrontEndPool) over one engine, `server.replicas` engine processes,
    or the engines already `listening` at those sockets (Ray replicas, more of which `spawn` starts as the pool
    grows); exit status 1 when an engine stops on its own and is not built again (one engine: never)."""
    from mtpserve.cluster.service.front_end_pool import FrontEndPool

    try:
        pool = FrontEndPool(cfg, cfg.server.num_frontends, listening=listening, spawn=spawn)
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:  # a port that cannot be bound
        sc = cfg.server
        ports = f"port {sc.port}, http_port {sc.http_port}, metrics_port {sc.metrics_port}"
        print(f"mtpserve: cannot serve on {sc.host} ({ports}): {exc}", file=sys.stderr)
        return 2
    if stop is None:
        stop = threading.Event()
        install_stop_signals(stop)
    rc = 0
    print(f"mtpserve: {serving_line(pool.address, pool.metrics_port, pool.http_address)}", flush=True)
    try:
        while not stop.wait(0.5):
            if not pool.engine_running:
                print("mtpserve: the engine stopped (see the log above); exiting", file=sys.stderr, flush=True)
                rc = 1
                break
    finally:
        pool.stop()
        log.info("stopped")
    print("mtpserve: stopped", flush=True)
    return rc


def serving_line(grpc_address: str, metrics_port: int | None, http_address: str | None) -> str:
    """What `serve` prints once it serves (tests and scripts parse it)."""
    line = f"serving gRPC on {grpc_address}, metrics on :{metrics_port}"
    return line + (f", HTTP on {http_address}" if http_address else "")


def serve_with_actor(cfg: MTPServeConfig, stop: threading.Event | None = None) -> int:
    """Serve from a scheduler actor until `stop` is set."""
    from mtpserve.cluster.distributed.scheduler_actor import start_scheduler_actor, stop_scheduler_actor

    try:
        actor, address, metrics_port, http_address = start_scheduler_actor(cfg)
    except Exception as exc:  # actor construction errors arrive wrapped by Ray
        print(f"mtpserve: could not start the scheduler actor: {exc}", file=sys.stderr)
        return 2
    if stop is None:
        stop = threading.Event()
        install_stop_signals(stop)
    print(f"mtpserve: {serving_line(address, metrics_port, http_address)} (scheduler actor)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        stop_scheduler_actor(actor)
    print("mtpserve: stopped", flush=True)
    return 0


def serve_ray_replicas(cfg: MTPServeConfig, stop: threading.Event | None = None) -> int:
    """`serve --replicas N` through Ray: N scheduler actors on this node, each with its workers placed by its own
    placement group anywhere in the cluster, behind this process's front ends (a FrontEndPool routing over all,
    which starts and stops more of them between `replicas` and `max_replicas`)."""
    import tempfile

    from mtpserve.cluster.distributed.scheduler_actor import (
        ReplicaActorEngine,
        start_replica_actors,
        stop_scheduler_actor,
    )
    from mtpserve.cluster.service.pool_engines import engine_addresses

    folder = tempfile.mkdtemp(prefix="mtpserve-replicas-")
    addresses = engine_addresses(folder, cfg.server.replicas, stem="replica")
    try:
        actors = start_replica_actors(cfg, addresses)
    except Exception as exc:  # actor construction errors arrive wrapped by Ray
        print(f"mtpserve: could not start the replicas' scheduler actors: {exc}", file=sys.stderr)
        return 2
    try:
        rc = serve_pooled(cfg, stop, listening=addresses, spawn=ReplicaActorEngine.spawner(cfg))
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                stop_scheduler_actor(actor)
        shutil.rmtree(folder, ignore_errors=True)
    return rc


def run(args: argparse.Namespace) -> int:
    """Entry point of `mtpserve serve`."""
    cfg = config_from_args(args)
    if args.print_config:
        print_config(cfg)
        return 0
    return serve(cfg)
