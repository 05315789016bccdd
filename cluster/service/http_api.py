"""The OpenAI-compatible HTTP API (aiohttp): chat and text completions, streamed as server-sent events or whole,
`GET /v1/models` and `GET /health`, over the same engine as the gRPC servicer.

Requests are validated by the models in cluster/service/openai_schema.py and by the engine, as gRPC requests are;
every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 naming the field,
401 without the bearer token (when one is configured), 404 for another model or path, 413 for a body over
`server.http_max_body_mb`, 429 when the queue is full, 503 while workers are down or the server stops.
A client that disconnects aborts its request (aiohttp cancels the handler), which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mtpserve.cluster.engine.chat_encoding import encode_chat, encode_text, has_chat_template
from mtpserve.cluster.engine.errors import InvalidRequestError, QueueFullError, WorkerUnavailableError
from mtpserve.cluster.engine.sampling_params import check_output_room, sampling_params
from mtpserve.cluster.service.auth import bearer
from mtpserve.cluster.service.choices import Choices
from mtpserve.cluster.service.detokenizer import Tokenizers
from mtpserve.cluster.service.engine_stream import EngineStream, Piece
from mtpserve.cluster.service.error_status import error_status
from mtpserve.cluster.service.logprobs_body import TokenTexts, chat_logprobs, completion_logprobs
from mtpserve.cluster.service.metrics import HTTP, ServerMetrics
from mtpserve.cluster.service.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    choice_body,
    completion_body,
    error_body,
    parse,
    usage_body,
)
from mtpserve.cluster.service.request_book import EngineCore, EngineFailure, ServerShuttingDown
from mtpserve.cluster.service.tool_calls import StreamedCalls, ToolUse, offer_tools
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = ("/health",)  # answered without the bearer token (Kubernetes probes cannot send one)
ERROR_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "queue_full"),
    503: ("server_error", "unavailable"),
}


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        kind, default_code = ERROR_KINDS.get(status, ("server_error", None))
        self.type = kind
        self.code = code if code is not None else default_code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> web.Response:
        """The error as an HTTP response."""
        return web.json_response(self.body(), status=self.status)


@dataclass
class ReplyShape:
    """How a request's reply is written: its id, chat or text completion, the tools it may call, and the text it
    starts with (the prompt, for a completion with `echo`)."""

    request_id: str
    chat: bool
    tools: ToolUse | None = None
    echo: str = ""


def _usage(ended: list[Piece]) -> dict[str, Any]:
    """`usage` of a request's choices: the prompt once, every choice's completion tokens, their drafts summed."""
    stats = SpecStats()
    for piece in ended:
        stats.merge(piece.stats or SpecStats())
    completion = sum(p.completion_tokens for p in ended)
    return usage_body(ended[0].prompt_tokens if ended else 0, completion, stats)


def api_error(exc: Exception, prompt_field: str) -> APIError:
    """The HTTP error of an engine-side exception; the engine's prompt fields are named as the caller sent them."""
    status = error_status(exc)
    if status.field is None:
        return APIError(status.http, status.message(), code="internal_error" if status.http == 500 else None)
    field = prompt_field if status.field in ("prompt", "prompt_token_ids") else status.field
    return APIError(status.http, status.message(field), param=field)


class OpenAIAPI:
    """Routes and handlers of the OpenAI-compatible API over one engine (EngineCore)."""

    def __init__(
        self,
        loop: EngineCore,
        tokenizers: Tokenizers,
        model_id: str,
        *,
        accepting: Callable[[], bool],
        serving: Callable[[], bool],
        token: bytes | None = None,
        metrics: ServerMetrics | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        body_timeout: float = 30.0,
    ) -> None:
        self.loop = loop
        self.tokenizers = tokenizers
        self.model_id = model_id
        self.accepting = accepting
        self.serving = serving
        self.token = token
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.created = int(time.time())
        self.token_texts = TokenTexts(tokenizers.decoder)

    def app(self) -> web.Application:
        """The aiohttp application (build it on the event loop that serves it)."""

        @web.middleware
        async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self._errors(request, handler)

        @web.middleware
        async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self._auth(request, handler)

        app = web.Application(middlewares=[errors, auth], client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # ---- middlewares -------------------------------------------------------------------------------
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except InvalidRequestError as exc:
            return api_error(exc, "prompt").response()
        except web.HTTPException as exc:  # routing (404, 405) and the body limit (413) raise these
            if exc.status < 400:
                raise
            reason = f"{request.method} {request.path}: {exc.reason.lower()}"
            if exc.status == 413:
                reason = f"body: larger than {self.max_body_bytes} bytes (server.http_max_body_mb)"
            return APIError(exc.status, reason).response()
        except Exception as exc:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return api_error(exc, "prompt").response()

    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token is None or request.path in OPEN_PATHS:
            return await handler(request)
        token = bearer(request.headers.items())
        if token is None:
            self._refused("missing")
            raise APIError(401, "missing bearer token: send the header 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.token):
            self._refused("invalid")
            raise APIError(401, "invalid bearer token")
        return await handler(request)

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(frontend=HTTP, reason=reason).inc()

    # ---- plain routes ------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, 503 when not (as grpc.health.v1 reports SERVING / NOT_SERVING)."""
        ok = self.serving()
        return web.json_response({"status": "serving" if ok else "not_serving"}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        """The one served model."""
        entry = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "mtpserve",
            "max_model_len": self.loop.info.max_model_len,
        }
        return web.json_response({"object": "list", "data": [entry]})

    # ---- completions -------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: the messages in the tokenizer's chat template."""
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self._json(request))
        self._check_model(req.model)
        tok = self.tokenizers.encoder
        if tok is None or not has_chat_template(tok):
            raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
        turns = [m.turn() for m in req.messages]
        size = sum(len(m.content.encode("utf-8")) for m in req.messages)
        self.tokenizers.check_length(size, self.loop.info.max_model_len, "messages")
        functions = req.functions()
        tools = offer_tools(tok, self.loop.info.architecture, functions, req.forces_call)
        defs = [{"type": "function", "function": f} for f in functions] or None
        try:
            ids = await asyncio.wrap_future(self.tokenizers.submit(encode_chat, turns, defs))
        except Exception as exc:  # a template may refuse a conversation (roles out of order)
            raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from None
        return await self._generate(request, req, ids, chat=True, tools=tools)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: the prompt as is (text without a template, or token ids)."""
        req: CompletionRequest = parse(CompletionRequest, await self._json(request))
        self._check_model(req.model)
        if isinstance(req.prompt, list):
            ids = list(req.prompt)
        elif self.tokenizers.encoder is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer; send token ids")
        else:
            self.tokenizers.check_length(len(req.prompt.encode("utf-8")), self.loop.info.max_model_len, "prompt")
            ids = await asyncio.wrap_future(self.tokenizers.submit(encode_text, req.prompt, False))
        return await self._generate(request, req, ids, chat=False)

    async def _json(self, request: web.Request) -> Any:
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout)  # over client_max_size: 413
        except asyncio.TimeoutError:
            raise APIError(408, f"body: not all sent within {self.body_timeout:g} s (server.body_timeout_s)") from None
        try:
            return json.loads(raw)
        except ValueError as exc:  # also UnicodeDecodeError
            raise APIError(400, f"body: not valid JSON ({exc})", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "body: JSON nested too deeply", code="invalid_json") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            message = f"model: '{model}' is not served here; this server serves '{self.model_id}'"
            raise APIError(404, message, "model", "model_not_found")

    async def _generate(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        ids: list[int],
        chat: bool,
        tools: ToolUse | None = None,
    ) -> web.StreamResponse:
        prompt_field = "messages" if chat else "prompt"
        if not self.accepting():
            raise APIError(503, "workers are down or the server is stopping")
        n, limit = len(ids), self.loop.info.max_model_len
        if n >= limit:
            raise InvalidRequestError(prompt_field, f"has {n} tokens; the model's maximum length is {limit}")
        field, asked = req.requested_max_tokens()
        if asked is not None:
            check_output_room(n, asked, limit, field)
        try:
            params = sampling_params(req.sampling(asked if asked is not None else limit - n))
        except InvalidRequestError as exc:
            raise InvalidRequestError(field if exc.field == "max_tokens" else exc.field, exc.reason) from None
        if tools is not None:
            params = tools.constrain(params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        decoder, keep = self.tokenizers.decoder, req.include_stop_str_in_output
        choices = Choices(lambda: EngineStream(self.loop, decoder, req.stop, keep_stop=keep), req.n)
        try:
            try:
                await choices.start(ids, params, rid)
            except (
                InvalidRequestError,
                QueueFullError,
                WorkerUnavailableError,
                EngineFailure,
                ServerShuttingDown,
            ) as exc:
                raise api_error(exc, prompt_field) from None
            shape = ReplyShape(rid, chat, tools, self._echo(req, ids))
            if req.stream:
                return await self._sse(request, req, choices, shape)
            return await self._whole(req, choices, shape)
        finally:
            choices.close()

    def _echo(self, req: ChatCompletionRequest | CompletionRequest, ids: list[int]) -> str:
        """The prompt's text when a completion asks for it back (`echo`), else empty."""
        if not isinstance(req, CompletionRequest) or not req.echo:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        decoder = self.tokenizers.decoder
        return "" if decoder is None else str(decoder.decode(ids))

    async def _whole(
        self, req: ChatCompletionRequest | CompletionRequest, choices: Choices, shape: ReplyShape
    ) -> web.Response:
        rid, chat, tools = shape.request_id, shape.chat, shape.tools
        n = len(choices.streams)
        texts: list[list[str]] = [[shape.echo] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs = [TokenLogprobs([], [], []) for _ in range(n)]
        last: list[Piece | None] = [None] * n
        try:
            async for i, piece in choices.pieces():
                texts[i].append(piece.text)
                ids[i].extend(piece.token_ids)
                if piece.logprobs is not None:
                    logprobs[i].extend(piece.logprobs)
                last[i] = piece
        except (WorkerUnavailableError, EngineFailure, ServerShuttingDown) as exc:
            raise api_error(exc, "prompt") from None
        bodies = []
        for i, end in enumerate(last):
            assert end is not None and end.finish_reason is not None
            choice = choice_body(
                chat, "".join(texts[i]), end.finish_reason, ids[i] if req.return_token_ids else None, delta=False
            )
            choice["index"] = i
            if req.logprobs_asked() is not None:
                choice["logprobs"] = self._logprobs(chat, logprobs[i], ids[i], 0)
            if tools is not None:
                content, calls = tools.fmt.split(choice["message"]["content"])
                if calls:
                    choice["message"] = {"role": "assistant", "content": content or None}
                    choice["message"]["tool_calls"] = [c.body() for c in calls]
                    choice["finish_reason"] = "tool_calls"
            bodies.append(choice)
        body = completion_body(chat, rid, int(time.time()), self.model_id, choices=bodies, chunk=False)
        body["usage"] = _usage([p for p in last if p is not None])
        return web.json_response(body)

    async def _sse(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        choices: Choices,
        shape: ReplyShape,
    ) -> web.StreamResponse:
        rid, chat, tools = shape.request_id, shape.chat, shape.tools
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created, ids, n = int(time.time()), req.return_token_ids, len(choices.streams)

        async def send(body: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")

        def chunk(index: int, text: str, reason: str | None, piece: Piece | None = None, first: bool = False) -> dict:
            token_ids = (piece.token_ids if piece is not None else []) if ids else None
            choice = choice_body(chat, text, reason, token_ids, delta=True, first=first)
            choice["index"] = index
            if piece is not None and piece.logprobs is not None:
                choice["logprobs"] = self._logprobs(chat, piece.logprobs, piece.token_ids, offsets[index])
            body = completion_body(chat, rid, created, self.model_id, choices=[choice], chunk=True)
            if req.include_usage:
                body["usage"] = None
            return body

        offsets = [0] * n  # text sent so far per choice: where a completion's logprobs count their text offsets from
        splitters = [StreamedCalls(tools.fmt) for _ in range(n)] if tools is not None else []
        ended: list[Piece] = []
        try:
            for i in range(n) if chat or shape.echo else ():
                await send(chunk(i, shape.echo, None, first=chat))
            try:
                async for i, piece in choices.pieces():
                    if piece.finish_reason is not None:
                        ended.append(piece)
                    if tools is not None:
                        await self._send_calls(send, chunk, splitters[i], i, piece=piece)
                        continue
                    await send(chunk(i, piece.text, piece.finish_reason, piece))
                    offsets[i] += len(piece.text)
                if req.include_usage:
                    last = completion_body(chat, rid, created, self.model_id, choices=[], chunk=True)
                    last["usage"] = _usage(ended)
                    await send(last)
            except (WorkerUnavailableError, EngineFailure, ServerShuttingDown) as exc:
                await send(chunk(0, "", "abort"))
                await send(api_error(exc, "prompt").body())  # the status line is sent: report it in the stream
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client left while we wrote; the caller aborts the request
            pass
        return resp

    @staticmethod
    async def _send_calls(send: Any, chunk: Any, splitter: StreamedCalls, index: int, piece: Piece) -> None:
        """A piece of a reply that may call tools: its content, each call completed in it as a `tool_calls` delta,
        and the finish (`tool_calls` once any call was made)."""
        text, calls = splitter.push(piece.text, last=piece.finish_reason is not None)
        if text or piece.logprobs is not None:
            await send(chunk(index, text, None, piece))
        for call in calls:
            body = chunk(index, "", None)
            body["choices"][0]["delta"] = {"tool_calls": [call.body(splitter.calls)]}
            splitter.calls += 1
            await send(body)
        if piece.finish_reason is not None:
            await send(chunk(index, "", "tool_calls" if splitter.calls else piece.finish_reason))

    def _logprobs(self, chat: bool, lp: TokenLogprobs, ids: list[int], offset: int) -> dict[str, Any]:
        if chat:
            return chat_logprobs(lp, ids, self.token_texts)
        return completion_logprobs(lp, ids, self.token_texts, offset)
