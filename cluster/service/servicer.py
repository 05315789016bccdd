"""The mtpserve.v1.Inference gRPC servicer over an engine (request_book.EngineCore), and the proto conversions it needs.

Each handler (a coroutine on the front-end event loop) validates the request, submits it to the engine loop
and streams the request's outputs back, several steps' tokens per message when the stream falls behind; engine
errors become gRPC status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, NoReturn

import grpc

from mtpserve.cluster.engine.chat_encoding import encode_chat, encode_text, has_chat_template
from mtpserve.cluster.engine.errors import InvalidRequestError, QueueFullError, WorkerUnavailableError
from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.cluster.engine.sampling_params import SamplingParams, check_output_room, sampling_params
from mtpserve.cluster.service.choices import MAX_CHOICES, Choices
from mtpserve.cluster.service.detokenizer import Tokenizers
from mtpserve.cluster.service.engine_stream import EngineStream, Piece
from mtpserve.cluster.service.error_status import error_status
from mtpserve.cluster.service.grpc_chat import call_to_proto, conversation_turns, offered_functions
from mtpserve.cluster.service.metrics import GRPC
from mtpserve.cluster.service.request_book import EngineCore, EngineFailure, ServerShuttingDown
from mtpserve.cluster.service.stop_strings import stop_strings_problem
from mtpserve.cluster.service.tool_calls import StreamedCalls, ToolUse, offer_tools
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# Engine field names -> the request's proto field paths, so INVALID_ARGUMENT names what the caller sent.
PROTO_FIELDS = {
    "prompt_token_ids": "prompt.token_ids",
    "stop_token_ids": "sampling.stop_token_ids",
    "logit_bias": "sampling.logit_bias",
    "max_tokens": "sampling.max_tokens",
}


MAX_REQUEST_ID_CHARS = 256
OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "min_p",
    "logprobs",
)


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
    data: dict[str, Any] = {name: getattr(msg, name) for name in OPTIONAL_SAMPLING if msg.HasField(name)}
    data["stop_token_ids"] = list(msg.stop_token_ids)
    data["ignore_eos"] = msg.ignore_eos
    data["logit_bias"] = dict(msg.logit_bias)
    problem = stop_strings_problem(list(msg.stop))
    if problem is not None:
        raise InvalidRequestError("sampling.stop", problem)
    kind = msg.WhichOneof("structured")
    if kind is not None and (kind != "json_object" or msg.json_object):
        value = "" if kind == "json_object" else getattr(msg, kind)
        data["grammar"] = GrammarSpec(kind, value, f"sampling.{kind}")
    return sampling_params(data, "sampling.")


def logprobs_to_proto(ids: list[int], lp: TokenLogprobs) -> list[pb.TokenLogprob]:
    """A chunk's logprobs, one TokenLogprob per token."""
    return [
        pb.TokenLogprob(
            token_id=tok, logprob=value, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(ti, tv, strict=True)]
        )
        for tok, value, ti, tv in zip(ids, lp.token_logprobs, lp.top_token_ids, lp.top_logprobs, strict=True)
    ]


def _abort_code(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    status = error_status(exc)
    return status.grpc, status.message(PROTO_FIELDS.get(status.field or "", status.field))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the RPC with a status; context.abort raises, and this tells the type checker so."""
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


def last_chunk(chunk: pb.GenerateResponse, piece: Piece) -> pb.GenerateResponse:
    """`chunk` with the finish reason, usage and statistics of a request's last piece."""
    chunk.finish_reason = FINISH_REASONS.get(piece.finish_reason or "", pb.FINISH_REASON_STOP)
    chunk.usage.prompt_tokens = piece.prompt_tokens
    chunk.usage.completion_tokens = piece.completion_tokens
    chunk.stats.CopyFrom(stats_to_proto(piece.stats or SpecStats()))
    return chunk


class InferenceServicer(pb_grpc.InferenceServicer):
    """mtpserve.v1.Inference on top of an engine (EngineCore), served by grpc.aio on the front-end event loop."""

    def __init__(self, loop: EngineCore, accepting: Callable[[], bool]) -> None:
        self.loop = loop
        self.accepting = accepting
        self.started = time.monotonic()
        self.tokenizers = Tokenizers(loop.tokenizer)

    async def _chat_ids(self, request: pb.GenerateRequest) -> tuple[list[int], ToolUse | None]:
        """A conversation's token ids in the chat template, and the tools its reply may call."""
        tok = self.tokenizers.encoder
        if tok is None or not has_chat_template(tok):
            raise InvalidRequestError("prompt.messages", "this model has no chat template; send text or token_ids")
        turns = conversation_turns(request.messages)
        size = sum(len(t.content.encode("utf-8", "surrogatepass")) for t in request.messages.turns)
        self.tokenizers.check_length(size, self.loop.info.max_model_len, "prompt.messages")
        functions, forced = offered_functions(request.tools, request.tool_choice)
        tools = offer_tools(tok, self.loop.info.architecture, functions, forced)
        defs = [{"type": "function", "function": f} for f in functions] or None
        try:
            ids = await asyncio.wrap_future(self.tokenizers.submit(encode_chat, turns, defs))
        except Exception as exc:  # a template may refuse a conversation (roles out of order)
            raise InvalidRequestError("prompt.messages", f"the chat template refused them: {exc}") from None
        return ids, tools

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "must be set: give text, token_ids or messages")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if not request.text:
            raise InvalidRequestError("prompt.text", "must not be empty")
        if self.tokenizers.encoder is None:
            raise InvalidRequestError("prompt.text", "this model has no tokenizer; send prompt.token_ids")
        size = len(request.text.encode("utf-8", "surrogatepass"))
        self.tokenizers.check_length(size, self.loop.info.max_model_len, "prompt.text")
        return await asyncio.wrap_future(self.tokenizers.submit(encode_text, request.text, not request.raw))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream a completion; cancellation or a passed deadline aborts the request."""
        if request.n > MAX_CHOICES:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"n: at most {MAX_CHOICES}, got {request.n}")
        stop, keep = list(request.sampling.stop), request.sampling.include_stop_str_in_output
        choices = Choices(
            partial(EngineStream, self.loop, self.tokenizers.decoder, stop, frontend=GRPC, keep_stop=keep),
            max(1, request.n),
        )
        # however the call ends (a cancel may leave this generator paused at a yield), the requests are aborted
        context.add_done_callback(lambda _: choices.close())
        rid, tools = await self._start(choices, request, context)
        splitters = [StreamedCalls(tools.fmt) for _ in choices.streams] if tools is not None else []
        try:
            async for i, piece in choices.pieces():
                chunk = pb.GenerateResponse(request_id=rid, token_ids=piece.token_ids, text=piece.text, index=i)
                if piece.logprobs is not None:
                    chunk.logprobs.extend(logprobs_to_proto(piece.token_ids, piece.logprobs))
                if splitters:
                    chunk.text, calls = splitters[i].push(piece.text, last=piece.finish_reason is not None)
                    chunk.tool_calls.extend(call_to_proto(c) for c in calls)
                    splitters[i].calls += len(calls)
                if piece.finish_reason is None:
                    yield chunk
                    continue
                chunk = last_chunk(chunk, piece)
                if splitters and splitters[i].calls:
                    chunk.finish_reason = pb.FINISH_REASON_TOOL_CALLS
                yield chunk
        except (WorkerUnavailableError, EngineFailure, ServerShuttingDown) as exc:
            await _abort(context, *_abort_code(exc))

    async def _start(
        self, choices: Choices, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, ToolUse | None]:
        """Validate and submit the request: its id, and the tools its reply may call."""
        if not self.accepting():
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "workers are down or the server is stopping")
        try:
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # it comes back in every chunk
                raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
            tools = None
            if request.WhichOneof("prompt") == "messages":
                ids, tools = await self._chat_ids(request)
            else:
                if request.tools:
                    raise InvalidRequestError("tools", "need a prompt given as messages")
                ids = await self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            if tools is not None and tools.forced is not None:
                if params.grammar is not None:
                    raise InvalidRequestError(
                        "tool_choice", "a required tool call cannot be combined with another format"
                    )
                params = params.model_copy(update={"grammar": tools.forced})
            limit = self.loop.info.max_model_len
            if request.sampling.HasField("max_tokens") and len(ids) < limit:  # a longer prompt: refused by its length
                check_output_room(len(ids), params.max_tokens, limit)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                await _abort(
                    context, grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request started"
                )
            await choices.start(ids, params, request.request_id or None)
        except (InvalidRequestError, QueueFullError, WorkerUnavailableError, EngineFailure, ServerShuttingDown) as exc:
            await _abort(context, *_abort_code(exc))
        return choices.request_id, tools

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Stop a request by id."""
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_CHARS:
            reason = f"must not be empty, nor over {MAX_REQUEST_ID_CHARS} characters"
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {reason}")
        try:
            return pb.AbortResponse(aborted=await asyncio.to_thread(self.loop.abort, request.request_id))
        except ServerShuttingDown as exc:
            await _abort(context, *_abort_code(exc))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        """Describe the target and the draft head."""
        return self.loop.info

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
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
