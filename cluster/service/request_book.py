"""Requests in flight as the front ends see them: their handles, the routing of engine outputs to them, the
serving metrics, and the engine state published for GetStats. `EngineCore` is what the front ends drive: the
engine on a thread of this process (engine_loop.py) or in a process of its own (engine_process.py)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.metrics import GRPC, EngineMetrics, ServerMetrics
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.speculative.stats import SpecStats

if TYPE_CHECKING:
    from mtpserve.cluster.engine.llm_engine import LLMEngine


class EngineFailure(Exception):
    """The engine raised while running a request; the request is dropped (gRPC UNAVAILABLE)."""


class ServerShuttingDown(Exception):
    """The server stopped before the request finished (gRPC UNAVAILABLE)."""


def step_error(exc: Exception) -> Exception:
    """What the requests in flight fail with when a step raises `exc`: a worker outage as it is, anything else
    as an EngineFailure naming it."""
    if isinstance(exc, WorkerUnavailableError):
        return exc
    return EngineFailure(f"the engine failed while running this request ({type(exc).__name__}: {exc})")


@dataclass
class WorkerHealth:
    """Whether the engine's last step found every worker up; `on_change` hears each change."""

    on_change: Callable[[bool], None] | None = None
    ok: bool = True

    def set(self, ok: bool) -> None:
        """Record the workers' state, telling `on_change` when it changed."""
        changed, self.ok = ok != self.ok, ok
        if changed and self.on_change is not None:
            self.on_change(ok)


@dataclass
class RequestHandle:
    """A request in flight: the engine side fills `events`, one front-end handler drains it.

    `on_event`, when given, is called (on the thread that queued the event) after each event is queued; an
    asyncio front end uses it to wake the coroutine that reads the queue."""

    request_id: str
    num_prompt_tokens: int
    frontend: str = GRPC
    on_event: Callable[[], None] | None = None
    events: deque[RequestOutput | Exception] = field(default_factory=deque)  # appended by one thread, popped by one
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)

    def put(self, event: RequestOutput | Exception) -> None:
        """Queue an event for the reader and tell it."""
        self.events.append(event)
        if self.on_event is not None:
            self.on_event()


@dataclass(frozen=True)
class EngineLoad:
    """The scheduler's state after a step: load, KV blocks, prefix-cache totals and the adaptive depth."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    depth_steps: dict[str, int] | None = None
    depth: int = 0
    steps: int = 0
    rows: int = 0
    preemptions: int = 0
    steps_launched: int = 0


def summed_loads(loads: list[EngineLoad]) -> EngineLoad:
    """Several engines' states as one: counts added up, the depth the deepest any ran."""
    kinds: dict[str, int] = {}
    for load in loads:
        for kind, n in (load.depth_steps or {}).items():
            kinds[kind] = kinds.get(kind, 0) + n
    return EngineLoad(
        running=sum(x.running for x in loads),
        waiting=sum(x.waiting for x in loads),
        kv_blocks_used=sum(x.kv_blocks_used for x in loads),
        kv_blocks_total=sum(x.kv_blocks_total for x in loads),
        kv_blocks_cached=sum(x.kv_blocks_cached for x in loads),
        prefix_query_tokens=sum(x.prefix_query_tokens for x in loads),
        prefix_hit_tokens=sum(x.prefix_hit_tokens for x in loads),
        depth_steps=kinds,
        depth=max((x.depth for x in loads), default=0),
        steps=sum(x.steps for x in loads),
        rows=sum(x.rows for x in loads),
        steps_launched=sum(x.steps_launched for x in loads),
        preemptions=sum(x.preemptions for x in loads),
    )


def observe_engine(m: EngineMetrics, load: EngineLoad) -> None:
    """Bring the engine-wide metrics up to the engine state `load`."""
    m.observe_load(load.running, load.waiting, load.kv_blocks_used, load.kv_blocks_total)
    m.observe_prefix_cache(load.prefix_query_tokens, load.prefix_hit_tokens, load.kv_blocks_cached)
    m.observe_depths(load.depth_steps or {}, load.depth)
    m.observe_steps(load.steps, load.rows, load.preemptions, load.steps_launched)


def engine_load(engine: LLMEngine) -> EngineLoad:
    """The engine's scheduler state now."""
    sched = engine.scheduler
    blocks = sched.blocks
    policy = sched.depth
    return EngineLoad(
        running=len(sched.running),
        waiting=sched.num_waiting,
        kv_blocks_used=blocks.num_blocks - blocks.num_free,
        kv_blocks_total=blocks.num_blocks,
        kv_blocks_cached=blocks.num_cached,
        prefix_query_tokens=sched.prefix_query_tokens,
        prefix_hit_tokens=sched.prefix_hit_tokens,
        depth_steps=dict(engine.kind_steps),
        depth=sched.k if policy is None else policy.depth,  # a fixed chain runs its K every step
        steps=engine.steps_run,
        rows=engine.rows_run,
        steps_launched=engine.steps_launched,
        preemptions=sched.num_preemptions,
    )


@dataclass
class LoopSnapshot:
    """Engine state published after every step (read without touching the engine)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    totals: SpecStats = field(default_factory=SpecStats)
    requests_finished: int = 0
    generated_tokens: int = 0
    kv_blocks_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


def _copy_stats(s: SpecStats) -> SpecStats:
    return replace(
        s, accepted_per_position=list(s.accepted_per_position), drafted_per_position=list(s.drafted_per_position)
    )


class RequestBook:
    """The handles of the requests in flight, and what their outputs do to the metrics and the snapshot.

    Not thread-safe: one thread at a time calls it (the engine thread, or the engine process's reader under
    its lock)."""

    def __init__(self, metrics: ServerMetrics | None, engine_wide: bool = True) -> None:
        self.metrics = metrics
        self.engine_wide = engine_wide  # `publish` sets the engine-wide metrics too (not for one replica of several)
        self.handles: dict[str, RequestHandle] = {}
        self.snapshot = LoopSnapshot()
        self._finished = 0
        self._generated = 0
        self._totals = SpecStats()  # over every request that ended: finished, aborted or failed

    def add(self, handle: RequestHandle) -> None:
        """Track a request the engine has taken."""
        self.handles[handle.request_id] = handle
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(frontend=handle.frontend).inc(handle.num_prompt_tokens)

    def route(self, outputs: list[RequestOutput]) -> list[tuple[RequestHandle, RequestOutput]]:
        """Update per-request bookkeeping and metrics; returns the outputs to deliver (unknown requests dropped)."""
        now = time.monotonic()
        deliveries = []
        generated: dict[str, int] = {}
        for out in outputs:
            handle = self.handles.get(out.request_id)
            if handle is None:
                continue
            n = len(out.new_token_ids)
            if n and handle.first_token_at is None:
                handle.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.labels(frontend=handle.frontend).observe(now - handle.arrival)
            elif n and handle.last_token_at is not None and self.metrics is not None:
                self.metrics.itl.labels(frontend=handle.frontend).observe((now - handle.last_token_at) / n)
            if n:
                handle.last_token_at = now
            handle.num_output_tokens = out.num_output_tokens
            handle.stats = out.stats
            generated[handle.frontend] = generated.get(handle.frontend, 0) + len(out.new_token_ids)
            if out.finished:
                del self.handles[out.request_id]
                self.finish(handle, out.finish_reason or "stop", out.timings)
            deliveries.append((handle, out))
        self._generated += sum(generated.values())
        if self.metrics is not None:
            for frontend, n in generated.items():
                self.metrics.generation_tokens.labels(frontend=frontend).inc(n)
        return deliveries

    def end_aborted(self, request_id: str, reason: str) -> bool:
        """Drop an aborted request and hand its reader a final "abort" output; False when it is not in flight."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return False
        out = RequestOutput(
            request_id,
            [],
            True,
            "abort",
            num_prompt_tokens=handle.num_prompt_tokens,
            num_output_tokens=handle.num_output_tokens,
            stats=handle.stats,
        )
        self.finish(handle, reason)
        handle.put(out)
        return True

    def take_all(self) -> dict[str, RequestHandle]:
        """Every request in flight, no longer tracked (end each with `end`)."""
        handles, self.handles = self.handles, {}
        return handles

    def end(self, handle: RequestHandle, error: Exception, reason: str) -> None:
        """End a request taken with `take_all` with an error for its reader."""
        self.finish(handle, reason)
        handle.put(error)

    def finish(self, handle: RequestHandle, reason: str, timings: tuple[float, float, float] | None = None) -> None:
        """Count a request that ended, and record it in the metrics (with the engine's `timings` of it: queued,
        prefill and decode seconds)."""
        self._finished += 1
        self._totals.merge(handle.stats)
        if self.metrics is None:
            return
        now = time.monotonic()
        first = handle.first_token_at
        decode_s = None if first is None else now - first
        self.metrics.observe_finish(reason, handle.num_output_tokens, decode_s, handle.stats, frontend=handle.frontend)
        self.metrics.e2e.labels(frontend=handle.frontend).observe(now - handle.arrival)
        if timings is not None:
            self.metrics.observe_phases(handle.frontend, *timings)

    def publish(self, load: EngineLoad) -> None:
        """Publish the snapshot and the load metrics for the engine state `load`."""
        self.snapshot = LoopSnapshot(
            running=load.running,
            waiting=load.waiting,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            totals=_copy_stats(self._totals),
            requests_finished=self._finished,
            generated_tokens=self._generated,
            kv_blocks_cached=load.kv_blocks_cached,
            prefix_query_tokens=load.prefix_query_tokens,
            prefix_hit_tokens=load.prefix_hit_tokens,
        )
        if self.engine_wide and self.metrics is not None and self.metrics.engine is not None:
            observe_engine(self.metrics.engine, load)


class EngineCore(Protocol):
    """The engine as both front ends drive it: queue and abort requests, read their outputs from their handles."""

    @property
    def snapshot(self) -> LoopSnapshot:
        """The engine state after the last step."""
        ...

    @property
    def running(self) -> bool:
        """True while the engine serves and is not stopping."""
        ...

    @property
    def healthy(self) -> bool:
        """True while the engine serves and the last step did not find workers down."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer, or None."""
        ...

    @property
    def info(self) -> pb.ModelInfo:
        """The served model, its draft and its limits."""
        ...

    def start(self) -> None:
        """Start serving."""
        ...

    def in_flight(self) -> int:
        """Requests taken or being added, and not yet ended."""
        ...

    def stop(self, timeout: float = 5.0) -> None:
        """Fail what is still in flight with ServerShuttingDown and stop."""
        ...

    def mark_healthy(self) -> None:
        """Clear a worker failure."""
        ...

    def submit_nowait(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        frontend: str = GRPC,
        on_event: Callable[[], None] | None = None,
    ) -> futures.Future[RequestHandle]:
        """Queue a request: a future of its handle, or of the error the engine refuses it with."""
        ...

    def abort(self, request_id: str, wait: bool = True, reason: str = "abort") -> bool:
        """Abort a request (frees its KV blocks); whether it was in flight."""
        ...
