"""One request on the engine loop, driven from an asyncio front end: submit it, then read text pieces (detokenized,
cut at stop strings) until it ends; leaving early aborts it, which frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from cluster.engine.request import SamplingParams
from cluster.engine.scheduler import RequestOutput
from cluster.service.detokenizer import IncrementalDetokenizer
from cluster.service.engine_loop import EngineLoop, RequestHandle, ServerShuttingDown
from cluster.service.metrics import HTTP
from cluster.service.stop_strings import StopStrings
from speculative.stats import SpecStats

SUBMIT_POLL_S = 1.0  # how often a pending submission re-checks that the engine loop still runs


@dataclass
class Piece:
    """New text and token ids of a request; the last piece has the finish reason, usage and statistics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None


class _Waker:
    """Sets an asyncio.Event from any thread (the engine loop calls it per event); a no-op once the event
    loop is closed."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __call__(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits for this request any more
            self._loop.call_soon_threadsafe(self.event.set)


class EngineStream:
    """A request submitted to the engine loop from a coroutine; `close()` aborts it unless it ended."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, lock: threading.Lock, stop: list[str]) -> None:
        self.loop = loop
        self.detok = IncrementalDetokenizer(tokenizer, lock) if tokenizer is not None else None
        self.stops = StopStrings(stop) if stop else None
        self.handle: RequestHandle | None = None
        self.done = False
        self._waker = _Waker()

    async def start(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Queue the request; raises what `EngineLoop.submit` raises (InvalidRequestError, QueueFullError,
        ServerShuttingDown). Cancelled meanwhile, the request is withdrawn or aborted."""
        fut = self.loop.submit_nowait(prompt_token_ids, params, request_id, HTTP, self._waker)
        try:
            self.handle = await self._result(fut)
        except BaseException:
            if not fut.cancel():  # already added (or failing): abort it once the loop has answered
                fut.add_done_callback(self._abort_if_added)
            raise

    async def _result(self, fut: futures.Future[RequestHandle]) -> RequestHandle:
        wrapped = asyncio.wrap_future(fut)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=SUBMIT_POLL_S)
            if done:
                return wrapped.result()
            if not self.loop.running:
                raise ServerShuttingDown("the server is shutting down")

    def _abort_if_added(self, fut: futures.Future[RequestHandle]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.loop.abort(fut.result().request_id, wait=False)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces as tokens arrive, the last with the finish reason ("stop" also when a stop string
        ended it, which aborts the request in the engine); an engine error is raised."""
        handle = self.handle
        assert handle is not None, "start() first"
        while True:
            event = await self._next(handle)
            if isinstance(event, Exception):
                self.done = True
                raise event
            piece = self._piece(handle, event)
            if piece.finish_reason is not None:
                self.done = True
                if piece.finish_reason == "stop" and not event.finished:
                    self.loop.abort(handle.request_id, wait=False, reason="stop")
                yield piece
                return
            if piece.text or piece.token_ids:
                yield piece

    def _piece(self, handle: RequestHandle, event: RequestOutput) -> Piece:
        ids = list(event.new_token_ids)
        text = self.detok.push(ids) if self.detok else ""
        if event.finished and self.detok:
            text += self.detok.flush()
        reason = (event.finish_reason or "stop") if event.finished else None
        if self.stops is not None:
            text = self.stops.push(text)
            if self.stops.hit:
                reason = "stop"
            elif event.finished:
                text += self.stops.flush()
        if reason is None:
            return Piece(text, ids)
        return Piece(text, ids, reason, handle.num_prompt_tokens, event.num_output_tokens, event.stats)

    async def _next(self, handle: RequestHandle) -> RequestOutput | Exception:
        """The request's next event; waits on the waker, cleared before the queue's last check."""
        while True:
            try:
                return handle.events.get_nowait()
            except queue.Empty:
                self._waker.event.clear()
            try:
                return handle.events.get_nowait()
            except queue.Empty:
                await self._waker.event.wait()

    def close(self) -> None:
        """Abort the request if it has not ended (the client left, or the server stops); frees its KV blocks."""
        if self.handle is not None and not self.done:
            self.done = True
            self.loop.abort(self.handle.request_id, wait=False)
