"""The mtpserve.v1.Inference gRPC servicer over an EngineLoop, and the proto conversions it needs.

Each handler validates the request, submits it to the engine loop and streams the request's outputs
back; engine errors become gRPC status codes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import grpc

from cluster.engine.errors import InvalidRequestError, QueueFullError, WorkerUnavailableError
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import SamplingParams, sampling_params
from cluster.service.detokenizer import IncrementalDetokenizer
from cluster.service.engine_loop import EngineFailure, EngineLoop, RequestHandle, ServerShuttingDown
from proto.mtpserve.v1 import inference_pb2 as pb
from proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from speculative.stats import SpecStats

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
    return sampling_params(data, "sampling.")


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
            kv_blocks_cached=snap.kv_blocks_cached,
            prefix_cache_query_tokens=snap.prefix_query_tokens,
            prefix_cache_hit_tokens=snap.prefix_hit_tokens,
            prefix_cache_hit_rate=snap.prefix_hit_tokens / max(1, snap.prefix_query_tokens),
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
            method=spec.method if engine.draft is not None else "",
            source=spec.draft or "",
            num_draft_tokens=engine.scheduler.k,
            lookahead_source=spec.lookahead_source,
            placement=cfg.parallel.draft_placement,
        ),
    )
