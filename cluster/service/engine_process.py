"""The engine in a process of its own, driven from the server's process through one pipe (an EngineCore).

The server's process keeps the front ends, the tokenizer, the request handles and the metrics; the child
(engine_child.py) keeps the engine and steps it without sharing an interpreter lock with them. The front ends'
event loop reads the child's outputs itself (no thread between them and the streams); one writer thread sends
adds and aborts, all that are queued in one message, so no front end ever waits on the pipe. If the child dies,
every request in flight fails with EngineFailure and the server reports NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mtpserve.cluster.engine.errors import ModelLoadError, WorkerUnavailableError
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.child_link import (
    ABORT,
    ABORTED,
    ADD,
    ADDED,
    BATCH,
    ENGINE_ENTRY,
    ERROR,
    FAIL,
    HEALTH,
    OUT,
    READY,
    STOP,
    STOPPED,
    spawn_child,
    unpack_outputs,
)
from mtpserve.cluster.service.metrics import GRPC, ServerMetrics
from mtpserve.cluster.service.request_book import (
    EngineFailure,
    EngineLoad,
    LoopSnapshot,
    RequestBook,
    RequestHandle,
    ServerShuttingDown,
    WorkerHealth,
)
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)
MESSAGES_PER_WAKE = 16


class EngineProcess:
    """An engine in another process, driven through a pipe: the same calls as EngineLoop. Without `pipe` it builds
    the engine from `cfg` in a spawned child (raising what the build raised there, such as ModelLoadError); with
    one, the engine is at its other end already (the Ray scheduler actor that started this front-end process).
    `on_serving` hears the engine's worker outages and recoveries."""

    def __init__(
        self,
        cfg: MTPServeConfig,
        event_loop: asyncio.AbstractEventLoop,
        metrics: ServerMetrics | None = None,
        on_health_change: Callable[[bool], None] | None = None,
        pipe: Connection | None = None,
        on_serving: Callable[[bool], None] | None = None,
        engine_wide_metrics: bool = True,
    ) -> None:
        self.cfg = cfg
        self._on_health_change = on_health_change
        self._on_serving = on_serving
        self._event_loop = event_loop
        self._proc: BaseProcess | None = None
        if pipe is None:
            self._conn, child_end = mp.Pipe()
            level = logging.getLogger().getEffectiveLevel()
            self._proc = spawn_child(ENGINE_ENTRY, (cfg, child_end, os.getpid(), level), "mtpserve-engine")
            child_end.close()
        else:
            self._conn = pipe
        self._info, self._tokenizer, self._last_load = self._wait_ready()
        self._book = RequestBook(metrics, engine_wide=engine_wide_metrics)
        self._book.publish(self._last_load)
        self._lock = threading.Lock()  # the book, the pending adds and the aborts asked before an add was answered
        self._pending: dict[int, tuple[RequestHandle, futures.Future[RequestHandle]]] = {}
        self._abort_reasons: dict[str, str] = {}  # aborts sent and not yet answered, with their finish reasons
        self._seq = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._workers = WorkerHealth(on_health_change)
        self._reading = False  # from start() until the child stopped or died
        self._over = False
        self._writer = threading.Thread(target=self._write, name="mtpserve-engine-writer", daemon=True)

    def _wait_ready(self) -> tuple[pb.ModelInfo, Any, EngineLoad]:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise ModelLoadError(f"the engine process {self._exit_status()} while it loaded the model") from None
        if msg[0] == ERROR:
            if self._proc is not None:
                self._proc.join(5.0)
            raise msg[1]
        assert msg[0] == READY, msg[0]
        return pb.ModelInfo.FromString(msg[1]), msg[2], msg[3]

    # ---- EngineCore ------------------------------------------------------------------------------
    @property
    def load(self) -> EngineLoad:
        """The engine's state after the last step the child reported."""
        return self._last_load

    @property
    def snapshot(self) -> LoopSnapshot:
        """The engine state after the last step the child reported."""
        return self._book.snapshot

    @property
    def running(self) -> bool:
        """True while the child serves and the process is not stopping."""
        return self._reading and not self._stopping.is_set()

    @property
    def healthy(self) -> bool:
        """True while the child serves and its last step did not find workers down."""
        return self.running and self._workers.ok

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (a copy the child sent), or None."""
        return self._tokenizer

    @property
    def info(self) -> pb.ModelInfo:
        """The served model, its draft and its limits, as the child described them."""
        return self._info

    @property
    def pid(self) -> int | None:
        """The engine process's id, when this object started it."""
        return None if self._proc is None else self._proc.pid

    def in_flight(self) -> int:
        """Requests taken or being added, and not yet ended."""
        with self._lock:
            return len(self._book.handles) + len(self._pending)

    def start(self) -> None:
        """Start sending commands, and routing the child's outputs on the event loop."""
        self._reading = True
        self._writer.start()
        self._on_loop(lambda: self._event_loop.add_reader(self._conn.fileno(), self._on_readable))

    def stop(self, timeout: float = 5.0) -> None:
        """Fail what is still in flight with ServerShuttingDown and stop the engine's side (a child that does not exit
        within `timeout` s is killed)."""
        self._stopping.set()
        if self._writer.ident is not None:
            self._outbox.put((STOP,))
            self._outbox.put(None)
        else:
            with contextlib.suppress(OSError):
                self._conn.send((STOP,))
        detached = self._on_loop(self._detach)
        if detached:  # else the loop may still read the pipe: two readers would tear its messages apart
            self._read_until_stopped(timeout)  # the last steps' outputs, then STOPPED, on this thread
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():  # it ignores SIGTERM
                log.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self._proc.kill()
                self._proc.join(5.0)
        if self._writer.ident is not None:
            self._writer.join(1.0)
        self._ended()
        if detached:
            self._conn.close()

    def mark_healthy(self) -> None:
        """Clear a worker failure."""
        self._workers.set(True)

    def submit_nowait(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        frontend: str = GRPC,
        on_event: Callable[[], None] | None = None,
    ) -> futures.Future[RequestHandle]:
        """Send a request to the engine without waiting: a future of its handle, or of the error the engine
        refuses it with (InvalidRequestError, QueueFullError). A caller that gives up must cancel the future, and
        abort the request if the future was already running or done."""
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = RequestHandle(rid, len(prompt_token_ids), frontend, on_event)
        fut: futures.Future[RequestHandle] = futures.Future()
        with self._lock:  # the add is queued in the order of the pending map, ahead of any abort of it
            if not self.running:
                raise ServerShuttingDown("the server is shutting down")
            seq = next(self._seq)
            self._pending[seq] = (handle, fut)
            self._outbox.put((ADD, seq, rid, list(prompt_token_ids), params))
        return fut

    def abort(self, request_id: str, wait: bool = True, reason: str = "abort") -> bool:
        """Abort a request (the child frees its KV blocks); True when it was in flight or being added. Never waits
        on the child: the request's stream ends when the child has answered, after the tokens it made before (or
        with its own finish, if it finished first)."""
        if self._stopping.is_set():
            return False
        with self._lock:
            known = request_id in self._book.handles or any(
                h.request_id == request_id for h, _ in self._pending.values()
            )
            if known:
                self._abort_reasons[request_id] = reason
                self._outbox.put((ABORT, request_id))
        return known

    # ---- the writer thread and the reader on the event loop -------------------------------------------------------
    def _write(self) -> None:
        """Send the queued commands, all that are queued in one message (one hand-off of the interpreter lock)."""
        while True:
            batch = [self._outbox.get()]
            while batch[-1] is not None:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            msgs = [m for m in batch if m is not None]
            try:
                if msgs:
                    self._conn.send(msgs[0] if len(msgs) == 1 else (BATCH, msgs))
            except OSError:  # the child is gone; the reader fails what is in flight
                return
            except Exception:
                log.exception("could not send commands to the engine process; stopping it")
                if self._proc is not None:
                    self._proc.kill()  # the reader then fails every request in flight
                return
            if batch[-1] is None:
                return

    def _on_readable(self) -> None:
        """On the event loop: route what the child sent; at its end (STOPPED, or a closed pipe), stop reading."""
        try:
            for _ in range(MESSAGES_PER_WAKE):  # then let the streams run; the loop calls again while any is left
                if not self._conn.poll():
                    return
                if not self._dispatch(self._conn.recv()):
                    break
            else:
                return
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("routing the engine process's outputs failed; the server stops serving")
        self._detach()
        self._ended()

    def _read_until_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with contextlib.suppress(EOFError, OSError):
            while self._reading and self._conn.poll(max(0.0, deadline - time.monotonic())):
                if not self._dispatch(self._conn.recv()):
                    return

    def _dispatch(self, msg: tuple[Any, ...]) -> bool:
        """Apply one message of the child; False once it has stopped."""
        tag = msg[0]
        if tag == OUT:
            self._on_outputs(msg[1], msg[2])
        elif tag == ADDED:
            self._on_added(msg[1], msg[2])
        elif tag == FAIL:
            self._on_failure(msg[1], msg[2])
        elif tag == ABORTED:
            self._on_aborted(msg[1], msg[2])
        elif tag == HEALTH:
            if self._on_serving is not None:
                self._on_serving(msg[1])
        elif tag == STOPPED:
            self._last_load = msg[1]
            return False
        return True

    def _detach(self) -> None:
        if not self._event_loop.is_closed():
            self._event_loop.remove_reader(self._conn.fileno())

    def _on_loop(self, fn: Callable[[], object]) -> bool:
        """Run `fn` on the event loop's thread: now when the loop is not running or this is its thread, else soon
        (waiting up to 5 s for it). True when it ran, or when the loop is closed."""
        loop = self._event_loop
        if loop.is_closed():
            return True
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here or not loop.is_running():
            fn()
            return True
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed meanwhile
            return True
        return done.wait(5.0)

    def _on_outputs(self, packed: list[Any], load: EngineLoad) -> None:
        outputs = unpack_outputs(packed)
        with self._lock:
            deliveries = self._book.route(outputs)
            self._last_load = load
            self._book.publish(load)
            for handle, out in deliveries:
                handle.put(out)
        if packed and not self._workers.ok:  # a step went through
            self._workers.set(True)

    def _on_added(self, seq: int, err: BaseException | None) -> None:
        with self._lock:  # decide here; resolve the future after, since its callbacks may call abort()
            handle, fut = self._pending.pop(seq)
            wanted = fut.set_running_or_notify_cancel()
            if err is not None:
                self._abort_reasons.pop(handle.request_id, None)
            elif wanted:
                self._book.add(handle)  # an abort already on its way ends it when the child answers
            elif handle.request_id not in self._abort_reasons:  # (abort() has sent its own)
                self._outbox.put((ABORT, handle.request_id))  # given up on before the engine took it
        if not wanted:
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(handle)

    def _on_aborted(self, request_id: str, load: EngineLoad) -> None:
        with self._lock:
            reason = self._abort_reasons.pop(request_id, None)
            if reason is not None:
                self._book.end_aborted(request_id, reason)  # no-op if the request finished first
            self._last_load = load
            self._book.publish(load)

    def _on_failure(self, err: Exception, load: EngineLoad) -> None:
        if isinstance(err, WorkerUnavailableError):
            log.error("workers are down: %s", err)
            self._workers.set(False)
        with self._lock:
            for handle in self._book.take_all().values():
                self._book.end(handle, err, "error")
            self._last_load = load
            self._book.publish(load)

    def _ended(self) -> None:
        """The child stopped or died: fail every pending add and request in flight (once)."""
        with self._lock:
            if self._over:
                return
            self._over = True
            self._reading = False
        stopping = self._stopping.is_set()
        self._stopping.set()
        self._outbox.put(None)
        if stopping:
            err: Exception = ServerShuttingDown("the server is shutting down")
        else:
            err = EngineFailure(f"the engine process {self._exit_status()}")
            log.error("%s; its requests fail and it takes no more", err)
        with self._lock:
            self._abort_reasons.clear()
            pending, self._pending = self._pending, {}
            for handle in self._book.take_all().values():
                self._book.end(handle, err, "abort" if stopping else "error")
            if not stopping:  # a dead engine holds nothing
                self._last_load = replace(self._last_load, running=0, waiting=0, kv_blocks_used=0)
            self._book.publish(self._last_load)
        for _, fut in pending.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        if self._on_health_change is not None:
            self._on_health_change(False)

    def _exit_status(self) -> str:
        if self._proc is None:
            return "closed its pipe"
        self._proc.join(0.5)
        return f"exited (exit code {self._proc.exitcode})"
