"""The engine loop: one thread owns the LLMEngine and is the only one that touches it.

Front-end threads (gRPC handlers, the HTTP event loop) hand it add/abort commands and read their request's
outputs from a per-request queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.engine.errors import WorkerUnavailableError
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import SamplingParams
from cluster.engine.scheduler import RequestOutput
from cluster.service.metrics import GRPC, ServerMetrics
from speculative.stats import SpecStats

log = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine raised while running a request; the request is dropped (gRPC UNAVAILABLE)."""


class ServerShuttingDown(Exception):
    """The server stopped before the request finished (gRPC UNAVAILABLE)."""


@dataclass
class RequestHandle:
    """A request in flight: the engine loop fills `events`, one front-end handler drains it.

    `on_event`, when given, is called (on the engine thread) after each event is queued; an asyncio
    front end uses it to wake the coroutine that reads the queue."""

    request_id: str
    num_prompt_tokens: int
    frontend: str = GRPC
    on_event: Callable[[], None] | None = None
    events: deque[RequestOutput | Exception] = field(default_factory=deque)  # appended by one thread, popped by one
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_output_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)

    def put(self, event: RequestOutput | Exception) -> None:
        """Queue an event for the reader and tell it."""
        self.events.append(event)
        if self.on_event is not None:
            self.on_event()


@dataclass
class LoopSnapshot:
    """Engine state published by the loop after every iteration (read without touching the engine)."""

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


@dataclass
class _Command:
    fn: Callable[[], Any]
    result: futures.Future[Any] = field(default_factory=futures.Future)


def _copy_stats(s: SpecStats) -> SpecStats:
    return replace(
        s, accepted_per_position=list(s.accepted_per_position), drafted_per_position=list(s.drafted_per_position)
    )


class EngineLoop:
    """Owns the engine on one thread: applies queued adds/aborts between steps and routes outputs.

    When a step raises, every in-flight request fails (WorkerUnavailableError, or EngineFailure for
    anything else), its blocks are freed, and the loop goes on serving new requests. A
    WorkerUnavailableError also marks the loop unhealthy until `mark_healthy()`.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        on_health_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self._on_health_change = on_health_change
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._handles: dict[str, RequestHandle] = {}
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine-loop", daemon=True)
        self._stopping = threading.Event()
        self._workers_ok = True
        self._finished = 0
        self._generated = 0
        self._totals = SpecStats()  # over every request that ended: finished, aborted or failed
        self.snapshot = LoopSnapshot()
        self._publish()
        engine.on_tokens = self._deliver  # a step's tokens reach their streams before its draft runs

    # ---- called from any thread ------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Fail what is still in flight with ServerShuttingDown and end the thread."""
        self._stopping.set()
        self._commands.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """True while the loop thread runs and is not stopping."""
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def healthy(self) -> bool:
        """True while the loop runs and the last step did not find workers down."""
        return self.running and self._workers_ok

    def mark_healthy(self) -> None:
        """Clear a worker failure (the distributed engine calls this once its actors are back)."""
        self._set_workers_ok(True)

    def submit_nowait(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        frontend: str = GRPC,
        on_event: Callable[[], None] | None = None,
    ) -> futures.Future[RequestHandle]:
        """Queue a request without waiting: a future of its handle, or of the error the engine refuses it with
        (InvalidRequestError, QueueFullError).
        A caller that gives up must cancel the future, and abort the request if the future was already
        running or done."""
        return self._queue(self._adder(prompt_token_ids, params, request_id, frontend, on_event)).result

    def _adder(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        frontend: str,
        on_event: Callable[[], None] | None,
    ) -> Callable[[], RequestHandle]:
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = RequestHandle(rid, len(prompt_token_ids), frontend, on_event)

        def add() -> RequestHandle:
            self.engine.add_request(prompt_token_ids, params, rid)
            self._handles[rid] = handle
            if self.metrics is not None:
                self.metrics.prompt_tokens.labels(frontend=frontend).inc(len(prompt_token_ids))
            return handle

        return add

    def abort(self, request_id: str, wait: bool = True, reason: str = "abort") -> bool:
        """Abort a request (frees its KV blocks); with wait=False returns at once (for RPC callbacks).
        `reason` is the finish reason the metrics record (a front end that ends a request on a stop string
        records "stop")."""
        if self._stopping.is_set():
            return False
        cmd = _Command(lambda: self._abort(request_id, reason))
        self._commands.put(cmd)
        return bool(self._wait(cmd)) if wait else True

    def _queue(self, fn: Callable[[], Any]) -> _Command:
        if self._stopping.is_set() or not self._thread.is_alive():
            raise ServerShuttingDown("the server is shutting down")
        cmd = _Command(fn)
        self._commands.put(cmd)
        return cmd

    def _wait(self, cmd: _Command) -> Any:
        """The command's result; ServerShuttingDown if the loop ended without running it."""
        while True:
            try:
                return cmd.result.result(timeout=1.0)
            except futures.TimeoutError:
                if not self._thread.is_alive():
                    raise ServerShuttingDown("the server is shutting down") from None

    # ---- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self._stopping.is_set():
                    break
                self._step_once()
        except BaseException:
            log.exception("the engine loop crashed; the server stops serving")
            raise
        finally:
            self._stopping.set()
            self._drain_on_stop()
            if self.engine.on_tokens == self._deliver:
                self.engine.on_tokens = None  # the engine may be driven directly again
            if self._on_health_change is not None:
                self._on_health_change(False)

    def _step_once(self) -> None:
        """One engine step; the snapshot is published before outputs reach their streams, so a client
        that has seen a token also sees the step's state in GetStats."""
        if not self.engine.has_unfinished():
            self._publish()
            return
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_all(exc)
            self._publish()
            return
        self._deliver(outputs)
        if not self._workers_ok:
            self._set_workers_ok(True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams, publishing the state first."""
        deliveries = self._route(outputs)
        self._publish()
        for handle, out in deliveries:
            handle.put(out)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            if cmd.result.set_running_or_notify_cancel():
                try:
                    cmd.result.set_result(cmd.fn())
                except BaseException as exc:
                    cmd.result.set_exception(exc)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str, reason: str = "abort") -> bool:
        handle = self._handles.pop(request_id, None)
        aborted = self.engine.abort(request_id)
        if handle is None:
            return aborted
        out = RequestOutput(
            request_id, [], True, "abort", handle.num_prompt_tokens, handle.num_output_tokens, handle.stats
        )
        self._record_finish(handle, reason)
        handle.put(out)
        return True

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[RequestHandle, RequestOutput]]:
        """Update per-request bookkeeping and metrics; returns the outputs to deliver."""
        now = time.monotonic()
        deliveries = []
        generated: dict[str, int] = {}
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            if out.new_token_ids and handle.first_token_at is None:
                handle.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.labels(frontend=handle.frontend).observe(now - handle.arrival)
            handle.num_output_tokens = out.num_output_tokens
            handle.stats = out.stats
            generated[handle.frontend] = generated.get(handle.frontend, 0) + len(out.new_token_ids)
            if out.finished:
                del self._handles[out.request_id]
                self._record_finish(handle, out.finish_reason or "stop")
            deliveries.append((handle, out))
        self._generated += sum(generated.values())
        if self.metrics is not None:
            for frontend, n in generated.items():
                self.metrics.generation_tokens.labels(frontend=frontend).inc(n)
        return deliveries

    def _fail_all(self, exc: Exception) -> None:
        if isinstance(exc, WorkerUnavailableError):
            log.error("workers are down: %s", exc)
            err: Exception = exc
            self._set_workers_ok(False)
        else:
            log.exception("engine step failed; failing %d in-flight requests", len(self._handles))
            err = EngineFailure(f"the engine failed while running this request ({type(exc).__name__}: {exc})")
        handles, self._handles = self._handles, {}
        for rid, handle in handles.items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; keep failing the rest
                log.exception("abort of %s after an engine failure raised", rid)
            self._record_finish(handle, "error")
            handle.put(err)
        dropped = self.engine.scheduler.forget_cached()  # the KV those keys point at may be gone
        if dropped:
            log.info("dropped %d prefix-cache blocks after the failure", dropped)

    def _drain_on_stop(self) -> None:
        err = ServerShuttingDown("the server is shutting down")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not None and cmd.result.set_running_or_notify_cancel():
                cmd.result.set_exception(err)
        handles, self._handles = self._handles, {}
        for rid, handle in handles.items():
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s at shutdown raised", rid)
            self._record_finish(handle, "abort")
            handle.put(err)
        try:
            self._publish()
        except Exception:
            log.exception("could not publish the final engine state")

    def _record_finish(self, handle: RequestHandle, reason: str) -> None:
        self._finished += 1
        self._totals.merge(handle.stats)
        if self.metrics is None:
            return
        first = handle.first_token_at
        decode_s = None if first is None else time.monotonic() - first
        self.metrics.observe_finish(reason, handle.num_output_tokens, decode_s, handle.stats, handle.frontend)

    def _set_workers_ok(self, ok: bool) -> None:
        changed = ok != self._workers_ok
        self._workers_ok = ok
        if changed and self._on_health_change is not None:
            self._on_health_change(ok)

    def _publish(self) -> None:
        sched = self.engine.scheduler
        blocks = sched.blocks
        used = blocks.num_blocks - blocks.num_free
        self.snapshot = LoopSnapshot(
            running=len(sched.running),
            waiting=sched.num_waiting,
            kv_blocks_used=used,
            kv_blocks_total=blocks.num_blocks,
            totals=_copy_stats(self._totals),
            requests_finished=self._finished,
            generated_tokens=self._generated,
            kv_blocks_cached=blocks.num_cached,
            prefix_query_tokens=sched.prefix_query_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
        )
        if self.metrics is not None:
            self.metrics.observe_load(len(sched.running), sched.num_waiting, used, blocks.num_blocks)
            self.metrics.observe_prefix_cache(sched.prefix_query_tokens, sched.prefix_hit_tokens, blocks.num_cached)
            if sched.depth is not None:
                self.metrics.observe_depths(sched.depth.step_counts(), sched.depth.depth)
