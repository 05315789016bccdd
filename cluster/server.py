"""Public gRPC server: an engine loop thread, the Inference servicer, health, reflection and metrics.

Threads: one `EngineLoop` thread owns the LLMEngine and is the only one that touches it. gRPC handler
threads hand it add/abort commands and read their request's outputs from a per-request queue.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from cluster.config import MTPServeConfig
from cluster.engine import LLMEngine
from cluster.errors import InvalidRequestError, QueueFullError, WorkerUnavailableError
from cluster.metrics import ServerMetrics
from cluster.request import SamplingParams
from cluster.scheduler import RequestOutput
from proto.mtpserve.v1 import inference_pb2 as pb
from proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from speculative.stats import SpecStats

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# Engine field names -> the request's proto field paths, so INVALID_ARGUMENT names what the caller sent.
PROTO_FIELDS = {
    "prompt_token_ids": "prompt.token_ids",
    "stop_token_ids": "sampling.stop_token_ids",
    "max_tokens": "sampling.max_tokens",
}
POLL_S = 0.25  # how often a blocked handler re-checks that its RPC is still alive


class EngineFailure(Exception):
    """The engine raised while running a request; the request is dropped (gRPC UNAVAILABLE)."""


class ServerShuttingDown(Exception):
    """The server stopped before the request finished (gRPC UNAVAILABLE)."""


# ---- the engine loop -----------------------------------------------------------------------------
@dataclass
class RequestHandle:
    """A request in flight: the engine loop fills `events`, one gRPC handler drains it."""

    request_id: str
    num_prompt_tokens: int
    events: queue.Queue[RequestOutput | Exception] = field(default_factory=queue.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_output_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)

    def next_event(self, timeout: float) -> RequestOutput | Exception | None:
        """The next output or error, or None if none arrived within `timeout` seconds."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


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

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Queue a request; raises InvalidRequestError / QueueFullError as the engine decides."""
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = RequestHandle(rid, len(prompt_token_ids))

        def add() -> RequestHandle:
            self.engine.add_request(prompt_token_ids, params, rid)
            self._handles[rid] = handle
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt_token_ids))
            return handle

        return self._call(add)

    def abort(self, request_id: str, wait: bool = True) -> bool:
        """Abort a request (frees its KV blocks); with wait=False returns at once (for RPC callbacks)."""
        if self._stopping.is_set():
            return False
        cmd = _Command(lambda: self._abort(request_id))
        self._commands.put(cmd)
        return bool(self._wait(cmd)) if wait else True

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._stopping.is_set() or not self._thread.is_alive():
            raise ServerShuttingDown("the server is shutting down")
        cmd = _Command(fn)
        self._commands.put(cmd)
        return self._wait(cmd)

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
        deliveries = self._route(outputs)
        self._publish()
        for handle, out in deliveries:
            handle.events.put(out)
        if not self._workers_ok:
            self._set_workers_ok(True)

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

    def _abort(self, request_id: str) -> bool:
        handle = self._handles.pop(request_id, None)
        aborted = self.engine.abort(request_id)
        if handle is None:
            return aborted
        out = RequestOutput(
            request_id, [], True, "abort", handle.num_prompt_tokens, handle.num_output_tokens, handle.stats
        )
        self._record_finish(handle, "abort")
        handle.events.put(out)
        return True

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[RequestHandle, RequestOutput]]:
        """Update per-request bookkeeping and metrics; returns the outputs to deliver."""
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            if out.new_token_ids and handle.first_token_at is None:
                handle.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - handle.arrival)
            handle.num_output_tokens = out.num_output_tokens
            handle.stats = out.stats
            self._generated += len(out.new_token_ids)
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                del self._handles[out.request_id]
                self._record_finish(handle, out.finish_reason or "stop")
            deliveries.append((handle, out))
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
            handle.events.put(err)

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
            handle.events.put(err)
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
        self.metrics.observe_finish(reason, handle.num_output_tokens, decode_s, handle.stats)

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
        )
        if self.metrics is not None:
            self.metrics.observe_load(len(sched.running), sched.num_waiting, used, blocks.num_blocks)


# ---- text ----------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a short window of recent tokens twice (with and without the new ones) and emits the
    difference, holding text back while it ends in U+FFFD (a character whose bytes are not all in yet).
    """

    def __init__(self, tokenizer: Any, lock: threading.Lock) -> None:
        self.tokenizer = tokenizer
        self.lock = lock
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context that makes the next decode stable
        self.read_offset = 0  # tokens before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        with self.lock:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


# ---- proto conversion ----------------------------------------------------------------------------
def stats_to_proto(s: SpecStats) -> pb.AcceptanceStats:
    """SpecStats as the AcceptanceStats message."""
    return pb.AcceptanceStats(
        drafted=s.drafted,
        accepted=s.accepted,
        verify_steps=s.verify_steps,
        acceptance_rate=s.acceptance_rate,
        acceptance_length=s.acceptance_length,
        accepted_per_position=s.per_position_rates(),
        accepted_count_per_position=s.accepted_per_position,
        drafted_count_per_position=s.drafted_per_position,
    )


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; unset optional fields take the defaults. Raises InvalidRequestError."""
    data: dict[str, Any] = {
        name: getattr(msg, name)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")
        if msg.HasField(name)
    }
    data["stop_token_ids"] = list(msg.stop_token_ids)
    data["ignore_eos"] = msg.ignore_eos
    try:
        return SamplingParams.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise InvalidRequestError(f"sampling.{loc}", err["msg"].lower()) from None


def _abort_code(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        name = PROTO_FIELDS.get(exc.field, exc.field)
        return grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {exc.reason}"
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {exc}"
    if isinstance(exc, WorkerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, f"workers are down: {exc}"
    if isinstance(exc, EngineFailure | ServerShuttingDown):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the RPC with a status; context.abort raises, and this tells the type checker so."""
    context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


# ---- the servicer --------------------------------------------------------------------------------
class InferenceServicer(pb_grpc.InferenceServicer):
    """mtpserve.v1.Inference on top of an EngineLoop."""

    def __init__(self, loop: EngineLoop, accepting: Callable[[], bool]) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.accepting = accepting
        self.started = time.monotonic()
        self.tokenizer_lock = threading.Lock()

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "must be set: give text or token_ids")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if not request.text:
            raise InvalidRequestError("prompt.text", "must not be empty")
        if self.engine.tokenizer is None:
            raise InvalidRequestError("prompt.text", "this model has no tokenizer; send prompt.token_ids")
        with self.tokenizer_lock:
            return self.engine.encode_prompt(request.text, chat=not request.raw)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """Stream a completion; cancellation or a passed deadline aborts the request."""
        handle = self._start(request, context)
        rid = handle.request_id
        if not context.add_callback(lambda: self.loop.abort(rid, wait=False)):
            self.loop.abort(rid, wait=False)  # the RPC ended before the callback was registered
        detok = IncrementalDetokenizer(self.engine.tokenizer, self.tokenizer_lock) if self.engine.tokenizer else None
        while True:
            event = handle.next_event(POLL_S)
            if event is None:
                if not context.is_active():
                    self.loop.abort(rid, wait=False)
                    return
                continue
            if isinstance(event, Exception):
                _abort(context, *_abort_code(event))
            chunk = pb.GenerateResponse(request_id=rid, token_ids=event.new_token_ids)
            chunk.text = detok.push(event.new_token_ids) if detok else ""
            if not event.finished:
                yield chunk
                continue
            if detok:
                chunk.text += detok.flush()
            chunk.finish_reason = FINISH_REASONS.get(event.finish_reason or "", pb.FINISH_REASON_STOP)
            chunk.usage.prompt_tokens = event.num_prompt_tokens
            chunk.usage.completion_tokens = event.num_output_tokens
            chunk.stats.CopyFrom(stats_to_proto(event.stats))
            yield chunk
            return

    def _start(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RequestHandle:
        if not self.accepting():
            _abort(context, grpc.StatusCode.UNAVAILABLE, "workers are down or the server is stopping")
        try:
            ids = self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request started")
            return self.loop.submit(ids, params, request.request_id or None)
        except (InvalidRequestError, QueueFullError, WorkerUnavailableError, ServerShuttingDown) as exc:
            _abort(context, *_abort_code(exc))

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Stop a request by id."""
        if not request.request_id:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        try:
            return pb.AbortResponse(aborted=self.loop.abort(request.request_id))
        except ServerShuttingDown as exc:
            _abort(context, *_abort_code(exc))

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        """Describe the target and the draft head."""
        return model_info(self.engine)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        """Aggregate acceptance statistics, load and KV use."""
        snap = self.loop.snapshot
        return pb.GetStatsResponse(
            totals=stats_to_proto(snap.totals),
            requests_running=snap.running,
            requests_waiting=snap.waiting,
            kv_blocks_used=snap.kv_blocks_used,
            kv_blocks_total=snap.kv_blocks_total,
            requests_finished=snap.requests_finished,
            generated_tokens=snap.generated_tokens,
            uptime_s=time.monotonic() - self.started,
        )


def model_info(engine: LLMEngine) -> pb.ModelInfo:
    """ModelInfo for an engine, from its config and architecture."""
    cfg, args = engine.cfg, engine.args
    arch, name = "LlamaForCausalLM", DEFAULT_MODEL_NAME
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        name = path.stem if path.is_file() else path.resolve().name
        conf = path / "config.json"
        if conf.is_file():
            arch = (json.loads(conf.read_text()).get("architectures") or [arch])[0]
    spec = cfg.speculative
    device = getattr(engine.target, "device", None) or cfg.model.device
    return pb.ModelInfo(
        model_name=name,
        architecture=arch,
        vocab_size=args.vocab_size,
        max_model_len=engine.max_model_len,
        hidden_size=args.hidden_size,
        num_layers=args.num_hidden_layers,
        tp_size=cfg.parallel.tp_size,
        device=str(getattr(device, "type", device)),
        dtype=cfg.model.dtype,
        has_tokenizer=engine.tokenizer is not None,
        block_size=cfg.scheduler.block_size,
        draft=pb.DraftInfo(
            enabled=engine.draft is not None,
            method="mtp_eagle" if engine.draft is not None else "",
            source=spec.draft or "",
            num_draft_tokens=engine.scheduler.k,
            lookahead_source=spec.lookahead_source,
            placement=cfg.parallel.draft_placement,
        ),
    )


# ---- the server ----------------------------------------------------------------------------------
def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MTPServer:
    """The gRPC server (Inference, Health, reflection), its engine loop and its metrics endpoint."""

    def __init__(self, engine: LLMEngine, cfg: MTPServeConfig | None = None, metrics: bool = True) -> None:
        self.cfg = cfg or engine.cfg
        self.engine = engine
        self.metrics = ServerMetrics()
        self._metrics_on = metrics
        self._serving = True
        self.health = health.HealthServicer()
        self.loop = EngineLoop(engine, self.metrics, on_health_change=lambda _ok: self._refresh_health())
        self.servicer = InferenceServicer(self.loop, self.accepting)
        engine.health_listeners.append(self.set_serving)
        self.port = 0
        self.metrics_port: int | None = None
        self._grpc: grpc.Server | None = None

    @property
    def address(self) -> str:
        """host:port the gRPC server is bound to."""
        return _host_port(self.cfg.server.host, self.port)

    def accepting(self) -> bool:
        """Whether Generate takes new requests: not stopped, set_serving(False) not in force, loop alive.

        A step that found workers down does not close the door: the next request tries again, and a
        step that succeeds marks the loop healthy again.
        """
        return self._serving and self.loop.running

    def is_serving(self) -> bool:
        """Health SERVING: accepting requests and the last step found every worker up."""
        return self.accepting() and self.loop.healthy

    def set_serving(self, serving: bool) -> None:
        """Hook for the distributed engine: report every actor up (True) or some down (False)."""
        self._serving = serving
        if serving:
            self.loop.mark_healthy()
        self._refresh_health()

    def _refresh_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if self.is_serving() else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        """Start the engine loop, bind the gRPC port and the metrics endpoint."""
        sc = self.cfg.server
        limit = sc.max_message_mb * 1024 * 1024
        sched = self.cfg.scheduler
        workers = min(sched.max_num_requests + sched.max_queue, 1024) + 16
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mtpserve-grpc"),
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=workers,
        )
        pb_grpc.add_InferenceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        self.port = server.add_insecure_port(_host_port(sc.host, sc.port))
        self.loop.start()
        server.start()
        self._grpc = server
        if self._metrics_on:
            self.metrics_port = self.metrics.start_http(sc.metrics_port, sc.host)
        self._refresh_health()
        log.info("gRPC on %s, metrics on %s", self.address, self.metrics_port)

    def stop(self, grace: float = 1.0) -> None:
        """Report NOT_SERVING, stop accepting RPCs, cancel streams after `grace` s, stop the loop."""
        self._serving = False
        self.health.enter_graceful_shutdown()
        if self._grpc is not None:
            self._grpc.stop(grace).wait(grace + 2.0)
        self.loop.stop()
        self.metrics.stop_http()
