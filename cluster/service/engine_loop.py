"""The engine loop: one thread owns the LLMEngine and is the only one that touches it.

Front-end threads (gRPC handlers, the HTTP event loop) hand it add/abort commands and read their request's
outputs from a per-request queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.metrics import GRPC, ServerMetrics
from mtpserve.cluster.service.model_info import model_info
from mtpserve.cluster.service.request_book import (
    LoopSnapshot,
    RequestBook,
    RequestHandle,
    ServerShuttingDown,
    WorkerHealth,
    engine_load,
    step_error,
)
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from mtpserve.cluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass
class _Command:
    fn: Callable[[], Any]
    result: futures.Future[Any] = field(default_factory=futures.Future)


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
        self._book = RequestBook(metrics)
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine-loop", daemon=True)
        self._stopping = threading.Event()
        self._workers = WorkerHealth(on_health_change)
        self._info: pb.ModelInfo | None = None
        self._publish()
        engine.on_tokens = self._deliver  # a step's tokens reach their streams before its draft runs

    # ---- called from any thread ------------------------------------------------------------------
    @property
    def snapshot(self) -> LoopSnapshot:
        """The engine state after the last step."""
        return self._book.snapshot

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, or None."""
        return self.engine.tokenizer

    @property
    def info(self) -> pb.ModelInfo:
        """The served model, its draft and its limits."""
        if self._info is None:
            self._info = model_info(self.engine)
        return self._info

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
        return self.running and self._workers.ok

    def mark_healthy(self) -> None:
        """Clear a worker failure (the distributed engine calls this once its actors are back)."""
        self._workers.set(True)

    def in_flight(self) -> int:
        """Requests taken or being added (queued commands count), and not yet ended."""
        return len(self._book.handles) + self._commands.qsize()

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
        return self._queue(self._adder(prompt_token_ids, params, request_id, frontend, on_event=on_event)).result

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
            self._book.add(handle)
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
        if not self._workers.ok:
            self._workers.set(True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams, publishing the state first."""
        deliveries = self._book.route(outputs)
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
        known = request_id in self._book.handles
        aborted = self.engine.abort(request_id)
        return self._book.end_aborted(request_id, reason) if known else aborted

    def _fail_all(self, exc: Exception) -> None:
        err = step_error(exc)
        if isinstance(exc, WorkerUnavailableError):
            log.error("workers are down: %s", exc)
            self._workers.set(False)
        else:
            log.exception("engine step failed; failing %d in-flight requests", len(self._book.handles))
        self._end_all(err, "error")
        dropped = self.engine.scheduler.forget_cached()  # the KV those keys point at may be gone
        if dropped:
            log.info("dropped %d prefix-cache blocks after the failure", dropped)

    def _end_all(self, err: Exception, reason: str) -> None:
        for rid, handle in self._book.take_all().items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be broken; keep ending the rest
                log.exception("abort of %s raised", rid)
            self._book.end(handle, err, reason)

    def _drain_on_stop(self) -> None:
        err = ServerShuttingDown("the server is shutting down")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not None and cmd.result.set_running_or_notify_cancel():
                cmd.result.set_exception(err)
        self._end_all(err, "abort")
        try:
            self._publish()
        except Exception:
            log.exception("could not publish the final engine state")

    def _publish(self) -> None:
        self._book.publish(engine_load(self.engine))
