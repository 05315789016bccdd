"""The front ends in a process of their own, beside an engine that stays where it is: the Ray scheduler actor
keeps its distributed engine (and its workers) and steps it on a thread, while a spawned child serves gRPC,
HTTP and metrics over a pipe to it (engine_child.PipedEngine on this side, engine_process.EngineProcess on the
child's). The two no longer share one interpreter lock."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.engine_child import ERROR, PipedEngine, kill_at_exit, portable, send_ready, serve_as_child
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
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
START_TIMEOUT_S = 300.0
SHARE_EVERY_S = 0.02  # how often a front end sends the routes it made since the last time


class FrontEndError(MTPServeError):
    """The front ends' process could not start."""


class FrontEndProcess:
    """Serves `engine` through front ends in a spawned child, bound as `cfg.server` says (raising the child's
    error if they cannot start). `on_lost` is called if the child dies while serving."""

    def __init__(self, engine: LLMEngine, cfg: MTPServeConfig, on_lost: Callable[[], None]) -> None:
        ctx = mp.get_context("spawn")
        engine_end, child_engine_end = ctx.Pipe()
        self._control, child_control = ctx.Pipe()
        self._proc = ctx.Process(
            target=run_front_ends,
            args=(cfg, child_engine_end, child_control, os.getpid(), logging.getLogger().getEffectiveLevel()),
            name="mtpserve-front-ends",
            daemon=True,
        )
        self._proc.start()
        atexit.register(kill_at_exit, self._proc)
        child_engine_end.close()
        child_control.close()
        self._on_lost = on_lost
        self._drain_s = cfg.server.drain_timeout_s
        self._lock = threading.Lock()
        self._stopping = False
        self._serving = False
        self._engine_end = engine_end
        self._thread = threading.Thread(target=self._serve_engine, name="mtpserve-piped-engine", daemon=True)
        try:
            send_ready(engine, engine_end)
            self._engine = PipedEngine(engine, engine_end)
            self._thread.start()  # a child that fails to start stops the engine side through the pipe
            self.address, self.metrics_port, self.http_address = self._wait_serving()
        except BaseException:
            self._stopping = True
            self._proc.kill()
            self._proc.join(5.0)
            self._close()
            raise
        with self._lock:  # the child may have died already: then it is lost now
            self._serving = True
            lost = not self._thread.is_alive()
        if lost:
            self._lost()

    @property
    def pid(self) -> int | None:
        """The front-end process's id."""
        return self._proc.pid

    def _wait_serving(self) -> tuple[str, int | None, str | None]:
        msg = wait_serving(self._control, self._proc, "the front-end process")
        return msg[1], msg[2], msg[3]

    def _serve_engine(self) -> None:
        try:
            self._engine.run()
        except Exception:
            log.exception("serving the engine to the front ends failed")
        finally:
            self._engine_end.close()  # the front ends see the pipe close
            with self._lock:
                lost = self._serving and not self._stopping
            if lost:
                self._lost()

    def _lost(self) -> None:
        log.error("the front-end process is gone; nothing serves this engine any more")
        self._on_lost()

    def _close(self) -> None:
        for conn in (self._control, self._engine_end):
            conn.close()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the front ends (they drain their streams first), then the engine side."""
        if timeout is None:
            timeout = self._drain_s + 15.0
        with self._lock:
            self._stopping = True
        with contextlib.suppress(OSError):
            self._control.send((STOP_SERVING,))
        self._thread.join(timeout)
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._close()


def wait_serving(control: Connection, proc: BaseProcess, name: str) -> tuple[Any, ...]:
    """The SERVING message a front-end process sends on `control` once it serves; FrontEndError (or the child's
    own error) when it cannot start."""
    try:
        if not control.poll(START_TIMEOUT_S):
            raise FrontEndError(f"{name} did not start within {START_TIMEOUT_S:.0f} s")
        msg = control.recv()
    except (EOFError, OSError):
        proc.join(5.0)
        raise FrontEndError(f"{name} exited with code {proc.exitcode}") from None
    if msg[0] == ERROR:
        raise msg[1]
    return msg


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


class FrontEnd:
    """One front-end process of the pool, and the pipe it reports on."""

    def __init__(self, cfg: MTPServeConfig, engines: EngineSlots, index: int, metrics_dir: str) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self._send_lock = threading.Lock()
        self.control, child_control = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(
            target=run_front_ends,
            args=(
                cfg,
                engines,
                child_control,
                os.getpid(),
                logging.getLogger().getEffectiveLevel(),
                f"front end {index}",
            ),
            name=f"mtpserve-front-end-{index}",
            daemon=True,
        )
        with _environ(MULTIPROC_ENV, metrics_dir):  # the child's metrics go to the shared files
            self.proc.start()
        atexit.register(kill_at_exit, self.proc)
        child_control.close()

    def wait_serving(self) -> tuple[int, int | None]:
        """The gRPC and HTTP ports it bound, once it serves; FrontEndError (or its own error) if it cannot."""
        msg = wait_serving(self.control, self.proc, f"front end {self.index}")
        return msg[4], msg[5]

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send on its control pipe (from any thread); nothing if the pipe is closed."""
        with self._send_lock, contextlib.suppress(OSError):
            self.control.send(msg)

    def stop(self, timeout: float) -> None:
        """Ask it to stop (its streams end as at any server stop); kill it past `timeout` s."""
        self.send((STOP_SERVING,))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.control.close()


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` in this process's environment for the block (a spawned child copies it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
