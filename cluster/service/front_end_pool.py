"""Several front-end processes serving one engine, or engine replicas: what `mtpserve serve --frontends N` runs
(N > 1, no Ray; with `--replicas R`, R engine processes behind every front end).

One Python process caps how many tokens it can tokenize, detokenize and frame per second, well below what the
engine computes at 64 streams and more. So the engine runs in a process of its own (engine_child.py, listening
on a Unix socket), and N front-end processes (front_end_process.run_front_ends) connect to it, each with the
gRPC and HTTP APIs bound to the same ports (SO_REUSEPORT: the kernel spreads new connections over them). Each
front end adds and streams only its own requests; the engine sends each step's outputs to the front end that
owns them. This process supervises: it starts the engine and the front ends, starts a new front end in place of
one that dies (the engine aborts the dead one's requests, freeing their KV blocks), serves one /metrics view
of all (the front ends write Prometheus's multiprocess files; the engine-wide gauges come from the engine's
state, sent here), and stops everything in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, multiprocess

from mtpserve.cluster.engine.errors import ModelLoadError
from mtpserve.cluster.service.auth import metrics_token
from mtpserve.cluster.service.child_link import ERROR, FAIL, HEALTH, OUT, READY, STOP, STOPPED
from mtpserve.cluster.service.front_end_child import DRAIN, DRAINED, GROW, ROUTES
from mtpserve.cluster.service.front_end_process import FrontEnd
from mtpserve.cluster.service.metrics import EngineMetrics
from mtpserve.cluster.service.metrics_http import MetricsEndpoint
from mtpserve.cluster.service.pool_engines import (
    EngineChild,
    EngineSlots,
    ListeningEngine,
    PoolEngine,
    engine_addresses,
)
from mtpserve.cluster.service.replica_scaling import Scaler
from mtpserve.cluster.service.request_book import EngineLoad, observe_engine, summed_loads
from mtpserve.cluster.service.server import host_port
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.workers.config import MTPServeConfig

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)
REBUILD_RETRY_S = 5.0  # after an engine failed to build again
SCALE_EVERY_S = 0.5  # how often the scaler reads the engines' loads


class FrontEndPool:
    """`count` front-end processes on the same ports beside an engine (see the module doc): `cfg.server.replicas`
    engines built from `cfg`, each in a process of its own, or one engine of this process that `local_engine` serves
    at the pool's socket (engine_child.EngineThread: the Ray scheduler actor's).
    Raises an engine's build error (ModelLoadError, ...) or a front end's start error.

    With one engine, the pool ends serving when the engine stops (`engine_running` turns False); with replicas, an
    engine that stops is built again at the same socket while the others serve, and the front ends connect to it
    again."""

    def __init__(
        self,
        cfg: MTPServeConfig,
        count: int,
        local_engine: Callable[[tuple[str, bytes]], PoolEngine] | None = None,
        listening: Sequence[tuple[str, bytes]] = (),
        spawn: Callable[[tuple[str, bytes]], PoolEngine] | None = None,
    ) -> None:
        self.cfg = cfg
        self._dir = tempfile.mkdtemp(prefix="mtpserve-")
        self._metrics_dir = os.path.join(self._dir, "metrics")
        os.mkdir(self._metrics_dir)
        n = len(listening) or (1 if local_engine is not None else cfg.server.replicas)
        slots = n if local_engine is not None else max(n, cfg.server.most_replicas)
        self._addresses = list(listening) + engine_addresses(self._dir, slots)[len(listening) :]
        self._spawn = spawn or (lambda address: EngineChild(cfg, address))
        self._count = n  # engines in slots 0..count-1 (the last one may be draining)
        self._draining: int | None = None  # the slot leaving, until every front end said DRAINED
        self._drain_waits: set[int] = set()  # the front ends (indexes) still to say so
        self._retired: set[int] = set()  # slots whose engine the pool stopped on purpose
        self.scaled: list[tuple[str, int]] = []  # ("up" | "down", slot), in order
        sc = cfg.server
        self._scaler = (
            Scaler(
                min_replicas=sc.replicas,
                max_replicas=sc.most_replicas,
                up_waiting=sc.scale_up_waiting,
                capacity=cfg.scheduler.max_num_requests,
                hold_s=sc.scale_hold_s,
            )
            if local_engine is None and sc.most_replicas > sc.replicas
            else None
        )
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._front_ends: list[FrontEnd] = []
        self._http_server: MetricsEndpoint | None = None
        self.engine_running = False
        self.engines_built = 0  # engines built again (or connected to again) after theirs stopped (replicas only)
        self.routes_relayed = 0  # ROUTES messages handed from one front end to the others
        self._engines: list[PoolEngine] = []
        self._readers: list[threading.Thread] = []  # one per engine: its state, until it says STOPPED
        try:
            if listening:
                self._engines.extend(ListeningEngine(a) for a in listening)
            elif local_engine is not None:
                self._engines.append(local_engine(self._addresses[0]))
            else:
                self._engines.extend(self._spawn(a) for a in self._addresses[:n])
            ready = [self._wait_engine(e) for e in self._engines]
            self.info = ready[0][0]
            self._loads = [load for _, load in ready]
            self.engine_running = True
            first = FrontEnd(cfg, EngineSlots(self._addresses, n), 0, self._metrics_dir)
            self._front_ends.append(first)
            self.port, self.http_port = first.wait_serving()
            # the others bind the ports the first one bound (it may have been given 0)
            self._bound = cfg.model_copy(
                update={"server": cfg.server.model_copy(update={"port": self.port, "http_port": self.http_port})}
            )
            more = [
                FrontEnd(self._bound, EngineSlots(self._addresses, n), i, self._metrics_dir) for i in range(1, count)
            ]
            self._front_ends.extend(more)
            for fe in more:
                fe.wait_serving()
            for fe in self._front_ends:
                self._start_relay(fe)
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self._metrics_dir)
            self._engine_metrics = EngineMetrics(registry)
            self._engine_metrics.set_model(self.info)
            self._observe(0, self._loads[0])
            self._http_server = MetricsEndpoint(
                registry, cfg.server.metrics_port, cfg.server.metrics_host, metrics_token(cfg.server)
            )
            self.metrics_port = self._http_server.port
        except BaseException:
            self.stop(timeout=5.0)
            raise
        for i in range(n):
            self._start_reader(i)
        threading.Thread(target=self._watch, name="mtpserve-front-end-watch", daemon=True).start()
        if self._scaler is not None:
            threading.Thread(target=self._scale, args=(self._scaler,), name="mtpserve-scaling", daemon=True).start()

    @property
    def address(self) -> str:
        """host:port of the gRPC API."""
        return host_port(self.cfg.server.host, self.port)

    @property
    def http_address(self) -> str | None:
        """host:port of the HTTP API; None when it is off."""
        return None if self.http_port is None else host_port(self.cfg.server.host, self.http_port)

    @property
    def pids(self) -> list[int | None]:
        """The front-end processes' ids, in order."""
        with self._lock:
            return [fe.proc.pid for fe in self._front_ends]

    @property
    def engine_pids(self) -> list[int | None]:
        """The engine processes' ids, in order (None for an engine served from a thread)."""
        with self._lock:
            return [e.pid for e in self._engines]

    @property
    def loads(self) -> list[EngineLoad]:
        """Each engine slot's state as it last reported it."""
        with self._lock:
            return list(self._loads)

    @property
    def load(self) -> EngineLoad:
        """The running engines' states as last reported, added up."""
        with self._lock:
            return summed_loads(self._loads[: self._count])

    @property
    def engines_up(self) -> int:
        """Engines running (one being drained included; `loads` also keeps the last state of those stopped)."""
        with self._lock:
            return self._count

    def _wait_engine(self, engine: PoolEngine) -> tuple[pb.ModelInfo, EngineLoad]:
        try:
            msg = engine.control.recv()
        except (EOFError, OSError):
            raise ModelLoadError(f"{engine.status()} while it loaded the model") from None
        if msg[0] == ERROR:
            engine.join(5.0)
            raise msg[1]
        assert msg[0] == READY, msg[0]
        return pb.ModelInfo.FromString(msg[1]), msg[3]

    def _observe(self, i: int, load: EngineLoad) -> None:
        with self._lock:
            self._loads[i] = load
            observe_engine(self._engine_metrics, summed_loads(self._loads[: self._count]))

    def _start_reader(self, i: int) -> None:
        reader = threading.Thread(target=self._read_engine, args=(i,), name=f"mtpserve-engine-{i}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read_engine(self, i: int) -> None:
        """Engine i's state (a few times a second) into the engine-wide metrics, until it ends; then, with
        replicas, build it again."""
        while True:
            engine = self._engines[i]
            try:
                while True:
                    msg = engine.control.recv()
                    if msg[0] in (OUT, FAIL):
                        self._observe(i, msg[2])
                    elif msg[0] == HEALTH:
                        log.info("engine %d reports its workers %s", i, "up" if msg[1] else "down")
                    elif msg[0] == STOPPED:
                        break
            except (EOFError, OSError):
                pass
            except Exception:
                log.exception("reading engine %d's state failed", i)
            if self._stopping.is_set() or i in self._retired:
                return
            log.error("engine %d: %s", i, engine.status())
            if len(self._engines) == 1 or not self._build_again(i):  # one engine: serving ends with it
                self.engine_running = False
                return

    def _build_again(self, i: int) -> bool:
        """Replace stopped engine i with what its `again()` gives (a new engine at its socket, or a connection to
        the one its owner started again), retrying until it is ready; False when nothing replaces it or once
        stopping."""
        while not self._stopping.is_set():
            try:
                fresh = self._engines[i].again()
                if fresh is None:
                    return False
                with self._lock:
                    self._engines[i] = fresh
                self._observe(i, self._wait_engine(fresh)[1])
            except Exception:
                log.exception("engine %d could not be built again; trying again in %.0f s", i, REBUILD_RETRY_S)
                self._stopping.wait(REBUILD_RETRY_S)
                continue
            self.engines_built += 1
            log.info("engine %d is back; the front ends connect to it", i)
            return True
        return False

    def _start_relay(self, fe: FrontEnd) -> None:
        threading.Thread(target=self._relay, args=(fe,), name=f"mtpserve-relay-{fe.index}", daemon=True).start()

    def _relay(self, fe: FrontEnd) -> None:
        """Hand the routes front end `fe` reports to every other front end, until its pipe closes."""
        try:
            while True:
                msg = fe.control.recv()
                if msg[0] == DRAINED:
                    self._heard_drained(fe.index, msg[1])
                if msg[0] != ROUTES:
                    continue
                with self._lock:
                    self.routes_relayed += 1
                    others = [other for other in self._front_ends if other is not fe]
                for other in others:
                    other.send(msg)
        except (EOFError, OSError):
            pass

    def _watch(self) -> None:
        """Start a new front end in place of one that dies, on the same ports."""
        while not self._stopping.is_set():
            with self._lock:
                sentinels = {fe.proc.sentinel: fe for fe in self._front_ends}
            ready = mp_connection.wait(list(sentinels), timeout=0.5)
            for s in ready:
                fe = sentinels[s]  # type: ignore[index]  # wait() returns the sentinels it was given
                if self._stopping.is_set() or not self.engine_running:
                    return
                log.error("front end %d exited (exit code %s); starting another", fe.index, fe.proc.exitcode)
                if fe.proc.pid is not None:
                    multiprocess.mark_process_dead(fe.proc.pid, self._metrics_dir)
                fe.control.close()
                with self._lock:
                    in_service = self._count - (self._draining is not None)
                new = FrontEnd(self._bound, EngineSlots(self._addresses, in_service), fe.index, self._metrics_dir)
                try:
                    new.wait_serving()
                    self._start_relay(new)
                except Exception:
                    log.exception("front end %d could not be started again", fe.index)
                with self._lock:
                    self._front_ends[self._front_ends.index(fe)] = new
                    missed = range(in_service, self._count - (self._draining is not None))
                for slot in missed:  # engines added while it started
                    new.send((GROW, slot))
                self._heard_drained(fe.index, self._draining)  # the new one never routed to a leaving slot

    # ---- scaling (server.max_replicas) --------------------------------------------------------------
    def _scale(self, scaler: Scaler) -> None:
        """Every SCALE_EVERY_S, what `scaler` asks of the engines in service: one more (built, then every front end
        connects to it) or one fewer (every front end stops sending it requests; once each has nothing left in
        flight there, it is stopped)."""
        while not self._stopping.wait(SCALE_EVERY_S):
            with self._lock:
                if self._draining is not None:
                    continue
                loads = [(load.running, load.waiting) for load in self._loads[: self._count]]
            action = scaler.decide(loads, time.monotonic())
            if action == "up":
                self._grow()
            elif action == "down":
                self._drain()

    def _grow(self) -> None:
        slot = self._count
        log.info("requests wait at every engine: adding engine %d", slot)
        try:
            engine = self._spawn(self._addresses[slot])
            load = self._wait_engine(engine)[1]
        except Exception:
            log.exception("engine %d could not be built; the pool stays at %d", slot, slot)
            return
        with self._lock:
            if slot < len(self._engines):
                self._engines[slot], self._loads[slot] = engine, load
            else:
                self._engines.append(engine)
                self._loads.append(load)
            self._retired.discard(slot)
            self._count += 1
            self.scaled.append(("up", slot))
            front_ends = list(self._front_ends)
        self._start_reader(slot)
        for fe in front_ends:
            fe.send((GROW, slot))

    def _drain(self) -> None:
        with self._lock:
            slot = self._count - 1
            self._draining = slot
            self._drain_waits = {fe.index for fe in self._front_ends}
            self.scaled.append(("down", slot))
            front_ends = list(self._front_ends)
        log.info("the load fits fewer engines: engine %d takes no new requests and stops when idle", slot)
        for fe in front_ends:
            fe.send((DRAIN, slot))

    def _heard_drained(self, front_end: int, slot: int | None) -> None:
        """Front end `front_end` has nothing in flight on `slot` any more; the last one to say so stops it."""
        with self._lock:
            if slot is None or slot != self._draining or front_end not in self._drain_waits:
                return
            self._drain_waits.discard(front_end)
            if self._drain_waits:
                return
            self._retired.add(slot)
            engine = self._engines[slot]
        threading.Thread(target=self._retire, args=(slot, engine), name=f"mtpserve-retire-{slot}", daemon=True).start()

    def _retire(self, slot: int, engine: PoolEngine) -> None:
        with contextlib.suppress(OSError):
            engine.control.send((STOP,))
        engine.join(self.cfg.server.drain_timeout_s + 15.0)
        engine.close()
        with self._lock:
            self._count -= 1
            self._draining = None
            observe_engine(self._engine_metrics, summed_loads(self._loads[: self._count]))
        log.info("engine %d stopped; %d in service", slot, self._count)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the front ends (in parallel; each drains its streams first), then the engines; remove the pool's
        files."""
        if timeout is None:
            timeout = self.cfg.server.drain_timeout_s + 15.0
        self._stopping.set()
        with self._lock:
            front_ends = list(self._front_ends)
            engines = [e for i, e in enumerate(self._engines) if i not in self._retired]
        stoppers = [threading.Thread(target=fe.stop, args=(timeout,)) for fe in front_ends]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        for engine in engines:
            with contextlib.suppress(OSError):
                engine.control.send((STOP,))
        for engine in engines:
            engine.join(timeout)
        for reader in self._readers:
            reader.join(5.0)  # until its engine answered STOPPED: then its connection may close
        for engine in engines:
            engine.control.close()
            engine.close()
        if self._http_server is not None:
            self._http_server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
