"""Several engines behind one front end (`serve --replicas N`): `ReplicaSet` offers the calls of one engine
(`EngineCore`) and sends each request to one replica, chosen by cached prefix and load (`PrefixRouter`) or in
turn; aborts go to the replica that took the request. The replicas' states add up to one snapshot and one set of
engine-wide metrics. A replica whose engine stops takes no more requests while the others serve, and is built
again (`build`) and put back in service. The set grows and shrinks as its pool says (front_end_pool.py, which
scales the engines for all its front ends): `grow` connects to one more engine; `drain` takes a replica out of
service, tells `on_drained` once this front end has nothing left in flight there, and parks the slot when its
engine stops (to be filled by the next growth)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.engine_process import EngineProcess
from mtpserve.cluster.service.metrics import EngineMetrics, ServerMetrics
from mtpserve.cluster.service.pool_engines import RECONNECT_WAIT_S, EngineSlots, connect_engine
from mtpserve.cluster.service.replica_router import PrefixRouter, RouteChoice
from mtpserve.cluster.service.request_book import (
    GRPC,
    EngineCore,
    EngineLoad,
    LoopSnapshot,
    RequestHandle,
    observe_engine,
    summed_loads,
)
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.speculative.stats import SpecStats
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)
PUBLISH_EVERY_S = 0.5  # how often the replicas' summed state reaches the engine-wide metrics
REVIVE_RETRY_S = 5.0  # after a failed rebuild of a dead replica


class Replica(EngineCore, Protocol):
    """An engine replica as the set drives it: an `EngineCore` that also reports its last step's state."""

    @property
    def load(self) -> EngineLoad:
        """The engine's state after the last step it reported."""
        ...


class RoundRobin:
    """Replicas in turn, skipping those out of service (the `PrefixRouter` calls the set makes)."""

    def __init__(self, replicas: int) -> None:
        self.live = set(range(replicas))
        self._turn = itertools.count()

    def learn(self, keys: Sequence[bytes], replica: int) -> None:
        """Turns know no prefixes."""

    def route(self, token_ids: Sequence[int]) -> RouteChoice:
        """The next live replica."""
        order = sorted(self.live)
        if not order:
            raise RuntimeError("no replica is live")
        return RouteChoice(order[next(self._turn) % len(order)], 0, "turn")

    def report_load(self, replica: int, running: int, waiting: int) -> None:
        """Load plays no part in turns."""

    def remove(self, replica: int) -> None:
        """Out of service."""
        self.live.discard(replica)

    def add(self, replica: int) -> None:
        """Back in service."""
        self.live.add(replica)


@dataclass
class RoutedCounts:
    """How requests were routed, by reason ('prefix', 'load', 'only', 'turn')."""

    by_reason: dict[str, int]
    by_replica: list[int]


class ReplicaSet:
    """N engine replicas behind one `EngineCore` (see the module docstring)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: PrefixRouter | RoundRobin,
        engine_metrics: EngineMetrics | None = None,
        build: Callable[[int], Replica] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = list(replicas)
        self.router = router
        self._engine_metrics = engine_metrics
        self._lock = threading.Lock()
        self.counts = RoutedCounts({}, [0] * len(self.replicas))
        self._build = build
        self._reviving: set[int] = set()  # slots being built (again, or by growth)
        self._draining: set[int] = set()  # leaving: no new requests; parked once their engine stops
        self._told_drained: set[int] = set()  # draining slots `on_drained` heard about
        self.parked: set[int] = set()  # slots a shrink emptied
        self.revived = 0  # replicas built again after their engine stopped
        self.on_drained: Callable[[int], object] | None = None  # hears a draining slot with nothing in flight here
        self._stopping = threading.Event()
        self._publisher = threading.Thread(target=self._watch, name="mtpserve-replicas", daemon=True)
        self.on_route: Callable[[list[bytes], int], None] | None = None  # hears each prompt's keys and replica

    # ---- EngineCore ------------------------------------------------------------------------------
    @property
    def snapshot(self) -> LoopSnapshot:
        """The replicas' snapshots added up."""
        total = LoopSnapshot(totals=SpecStats())
        for r in self.replicas:
            s = r.snapshot
            total.running += s.running
            total.waiting += s.waiting
            total.kv_blocks_used += s.kv_blocks_used
            total.kv_blocks_total += s.kv_blocks_total
            total.totals.merge(s.totals)
            total.requests_finished += s.requests_finished
            total.generated_tokens += s.generated_tokens
            total.kv_blocks_cached += s.kv_blocks_cached
            total.prefix_query_tokens += s.prefix_query_tokens
            total.prefix_hit_tokens += s.prefix_hit_tokens
        return total

    @property
    def running(self) -> bool:
        """True while any replica serves."""
        return any(r.running for r in self.replicas)

    @property
    def healthy(self) -> bool:
        """True while any replica serves with its workers up."""
        return any(r.healthy for r in self.replicas)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (every replica serves the same model)."""
        return self.replicas[0].tokenizer

    @property
    def info(self) -> pb.ModelInfo:
        """The served model (the first replica's description; they are alike)."""
        return self.replicas[0].info

    def start(self) -> None:
        """Start every replica, then the metrics publisher."""
        for r in self.replicas:
            r.start()
        self._publisher.start()

    def in_flight(self) -> int:
        """Requests in flight over all replicas."""
        return sum(r.in_flight() for r in self.replicas)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every replica (failing what each still has in flight)."""
        self._stopping.set()
        for i, r in enumerate(self.replicas):
            if i not in self.parked:  # a parked one has stopped already
                r.stop(timeout)

    def mark_healthy(self) -> None:
        """Clear worker failures on every replica."""
        for r in self.replicas:
            r.mark_healthy()

    def submit_nowait(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        frontend: str = GRPC,
        on_event: Callable[[], None] | None = None,
    ) -> futures.Future[RequestHandle]:
        """Route the request, then queue it on the chosen replica (`EngineCore.submit_nowait`)."""
        with self._lock:
            self._update_service()
            choice = self.router.route(prompt_token_ids)
            self.counts.by_reason[choice.reason] = self.counts.by_reason.get(choice.reason, 0) + 1
            self.counts.by_replica[choice.replica] += 1
        if self.on_route is not None and choice.keys:
            self.on_route(choice.keys, choice.replica)
        replica = self.replicas[choice.replica]
        return replica.submit_nowait(prompt_token_ids, params, request_id, frontend, on_event=on_event)

    def learn(self, routes: Sequence[tuple[list[bytes], int]]) -> None:
        """Prompts' block keys and the replicas other front ends sent them to, for this set's router."""
        with self._lock:
            for keys, replica in routes:
                self.router.learn(keys, replica)

    def abort(self, request_id: str, wait: bool = True, reason: str = "abort") -> bool:
        """Abort a request on the replica that has it (each knows its own in a look-up); False when none has it."""
        return any(r.abort(request_id, wait, reason) for r in self.replicas)

    # ---- routing state ---------------------------------------------------------------------------

    def _update_service(self) -> None:
        """Tell the router each replica's load, and which replicas serve: running, neither leaving nor parked (the
        one place the router's membership is decided; called under the lock)."""
        for i, r in enumerate(self.replicas):
            up = r.running and i not in self._draining and i not in self.parked
            if up and i not in self.router.live:
                self.router.add(i)
            elif not up and i in self.router.live:
                self.router.remove(i)
            s = r.snapshot
            self.router.report_load(i, s.running, s.waiting)

    # ---- metrics ---------------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """The replicas' last step states added up (the depth: the deepest any replica ran)."""
        return summed_loads([r.load for r in self.replicas])

    def _watch(self) -> None:
        """Every PUBLISH_EVERY_S: the summed state to the metrics, and a rebuild for each replica that stopped."""
        while not self._stopping.wait(PUBLISH_EVERY_S):
            if self._engine_metrics is not None:
                observe_engine(self._engine_metrics, self.load())
            if self._build is None:
                continue
            for i, replica in enumerate(list(self.replicas)):
                if not replica.running and i not in self._reviving | self._draining | self.parked:
                    log.warning("replica %d stopped; building it again", i)
                    self._start_build(i, replica)
            self._follow_drains()

    def _start_build(self, i: int, old: Replica | None) -> None:
        self._reviving.add(i)
        threading.Thread(target=self._rebuild, args=(i, old), daemon=True).start()

    # ---- growing and shrinking, as the pool says -------------------------------------------------------
    def grow(self, slot: int) -> None:
        """Connect to the engine the pool built for `slot` (the next one, or a parked one) and put it in service."""
        with self._lock:
            if slot in self._reviving or (slot < len(self.replicas) and slot not in self.parked):
                return  # already in service, or on its way
            if slot > len(self.replicas):
                raise ValueError(f"slot {slot} is past the next one ({len(self.replicas)})")
            self._reviving.add(slot)
        threading.Thread(target=self._rebuild, args=(slot, None), daemon=True).start()

    def drain(self, slot: int) -> None:
        """Send `slot` no new requests; its streams here run to their end (then `on_drained` hears of it)."""
        with self._lock:
            self._draining.add(slot)
            self._told_drained.discard(slot)
            self._update_service()

    def _follow_drains(self) -> None:
        """Tell `on_drained` of draining slots with nothing in flight here; park those whose engine stopped."""
        for slot in list(self._draining):
            replica = self.replicas[slot]
            if slot not in self._told_drained and replica.in_flight() == 0:
                self._told_drained.add(slot)
                if self.on_drained is not None:
                    self.on_drained(slot)
            if not replica.running:
                with self._lock:
                    self._draining.discard(slot)
                    self.parked.add(slot)
                replica.stop(1.0)

    def _rebuild(self, i: int, old: Replica | None) -> None:
        """Build replica i (replacing a stopped one, filling a parked slot, or appending) and put it in service,
        retrying until the set stops."""
        assert self._build is not None
        if old is not None:
            with contextlib.suppress(Exception):
                old.stop(1.0)
        while not self._stopping.is_set():
            try:
                fresh = self._build(i)
                fresh.start()
            except Exception:
                log.exception("rebuilding replica %d failed; trying again in %.0f s", i, REVIVE_RETRY_S)
                self._stopping.wait(REVIVE_RETRY_S)
                continue
            with self._lock:
                if self._stopping.is_set():
                    fresh.stop()
                    break
                if i == len(self.replicas):
                    self.replicas.append(fresh)
                    self.counts.by_replica.append(0)
                else:
                    self.replicas[i] = fresh
                self.revived += int(old is not None)
                self.parked.discard(i)
                self._update_service()
            log.info("replica %d is in service", i)
            break
        self._reviving.discard(i)


def start_replicas(
    cfg: MTPServeConfig,
    event_loop: asyncio.AbstractEventLoop,
    metrics: ServerMetrics,
    on_health_change: Callable[[bool], None],
    on_serving: Callable[[bool], None],
) -> ReplicaSet:
    """`cfg.server.replicas` engine processes, built at once, behind one set routed by `cfg.server.routing`;
    raises what a build raised (the others are stopped)."""
    n = cfg.server.replicas

    def build(_: int) -> EngineProcess:
        return EngineProcess(
            cfg, event_loop, metrics, on_health_change, on_serving=on_serving, engine_wide_metrics=False
        )

    with futures.ThreadPoolExecutor(n) as pool:
        jobs = [pool.submit(build, i) for i in range(n)]
    built = [j.result() for j in jobs if j.exception() is None]
    failed = [j.exception() for j in jobs if j.exception() is not None]
    if failed:
        for replica in built:
            replica.stop()
        raise failed[0]  # type: ignore[misc]
    return ReplicaSet(built, make_router(cfg, n), metrics.engine, build)


def make_router(cfg: MTPServeConfig, replicas: int) -> PrefixRouter | RoundRobin:
    """The router `cfg.server.routing` names, over `replicas` replicas."""
    if cfg.server.routing == "prefix":
        return PrefixRouter(replicas, cfg.scheduler.block_size)
    return RoundRobin(replicas)


def connect_replicas(
    cfg: MTPServeConfig,
    slots: EngineSlots,
    event_loop: asyncio.AbstractEventLoop,
    metrics: ServerMetrics,
    on_health_change: Callable[[bool], None],
    on_serving: Callable[[bool], None],
) -> ReplicaSet:
    """A set over the engines that run already in the first `slots.up` slots, each in its own process listening
    at its slot's address: what each of several front ends (front_end_pool.py) serves. A replica whose engine
    stops is connected to again once the pool has built it again at the same address; `grow` connects to the
    engine of a further slot."""

    def build(i: int) -> EngineProcess:
        conn = connect_engine(slots.addresses[i], RECONNECT_WAIT_S)
        return EngineProcess(
            cfg, event_loop, metrics, on_health_change, pipe=conn, on_serving=on_serving, engine_wide_metrics=False
        )

    built = [build(i) for i in range(slots.up)]
    return ReplicaSet(built, make_router(cfg, slots.up), None, build)
