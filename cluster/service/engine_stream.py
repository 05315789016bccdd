"""One request on the engine loop, driven from an asyncio front end (gRPC or HTTP): submit it, then read text
pieces (detokenized, cut at stop strings) until it ends; leaving early aborts it, which frees its KV blocks.

A piece carries every token that arrived since the last one, so a stream that falls behind the engine sends
fewer, larger pieces instead of a backlog of one-token ones."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any

from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.detokenizer import IncrementalDetokenizer
from mtpserve.cluster.service.metrics import HTTP
from mtpserve.cluster.service.request_book import EngineCore, RequestHandle, ServerShuttingDown
from mtpserve.cluster.service.stop_strings import StopStrings
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs

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
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked for them


class LoopWaker:
    """Sets asyncio.Events of one event loop from other threads; the events set in a burst (one engine step's
    outputs) cost the loop one wake-up, not one each. A no-op once the loop is closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Event] = []

    @classmethod
    def of_running_loop(cls) -> LoopWaker:
        """The waker of the running event loop."""
        loop = asyncio.get_running_loop()
        waker = _WAKERS.get(loop)
        if waker is None:
            waker = _WAKERS[loop] = cls(loop)
        return waker

    def wake(self, event: asyncio.Event) -> None:
        """Set `event` on the loop's thread, soon."""
        with self._lock:
            self._due.append(event)
            first = len(self._due) == 1
        if first:
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits any more
                self._loop.call_soon_threadsafe(self._set_due)

    def _set_due(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for event in due:
            event.set()


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()


class _Waker:
    """The per-request callback the engine loop calls after queueing an event."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._waker = LoopWaker.of_running_loop()

    def __call__(self) -> None:
        self._waker.wake(self.event)


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: both steps' tokens, the later one's state."""
    logprobs = then.logprobs
    if first.logprobs is not None and then.logprobs is not None:
        logprobs = first.logprobs.head(len(first.new_token_ids))
        logprobs.extend(then.logprobs)
    return replace(then, new_token_ids=[*first.new_token_ids, *then.new_token_ids], logprobs=logprobs)


class EngineStream:
    """A request submitted to the engine loop from a coroutine; `close()` aborts it unless it ended. `decoder` is a
    tokenizer that only the event loop's thread uses (`Tokenizers.decoder`), or None for token ids alone."""

    def __init__(
        self, loop: EngineCore, decoder: Any, stop: list[str], frontend: str = HTTP, keep_stop: bool = False
    ) -> None:
        self.loop = loop
        self.frontend = frontend
        self.detok = IncrementalDetokenizer(decoder) if decoder is not None else None
        self.stops = StopStrings(stop, keep_stop) if stop else None
        self.handle: RequestHandle | None = None
        self.done = False
        self._held: RequestOutput | Exception | None = None
        self._waker = _Waker()

    async def start(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None) -> None:
        """Queue the request; raises what the engine refuses it with (InvalidRequestError, QueueFullError) or
        ServerShuttingDown. Cancelled meanwhile, the request is withdrawn or aborted."""
        fut = self.loop.submit_nowait(prompt_token_ids, params, request_id, self.frontend, on_event=self._waker)
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
        count = event.num_output_tokens
        mark = (self.detok.mark(), self.stops.held) if self.detok and self.stops else None
        text = self.detok.push(ids) if self.detok else ""
        if event.finished and self.detok:
            text += self.detok.flush()
        reason = (event.finish_reason or "stop") if event.finished else None
        if self.stops is not None:
            text = self.stops.push(text)
            if self.stops.hit:
                reason = "stop"
                if mark is not None:
                    text, kept = self._cut_at_stop(ids, text, mark)
                    count -= len(ids) - len(kept)
                    ids = kept
            elif event.finished:
                text += self.stops.flush()
        logprobs = None if event.logprobs is None else event.logprobs.head(len(ids))
        if reason is None:
            return Piece(text, ids, logprobs=logprobs)
        return Piece(
            text, ids, reason, handle.num_prompt_tokens, completion_tokens=count, stats=event.stats, logprobs=logprobs
        )

    def _cut_at_stop(self, ids: list[int], text: str, mark: tuple[tuple[int, int, int], str]) -> tuple[str, list[int]]:
        """(text, token ids) up to the token that completes the stop string: one step may bring tokens past it."""
        assert self.stops is not None and self.detok is not None
        self.detok.rewind(mark[0])
        self.stops.rewind(mark[1])
        out = ""
        for k, tok in enumerate(ids):
            out += self.stops.push(self.detok.push([tok]))
            if self.stops.hit:
                return out, ids[: k + 1]
        self.stops.hit = True  # completed by text held back until the end
        return text, ids

    async def _next(self, handle: RequestHandle) -> RequestOutput | Exception:
        """Every output queued for the request, merged, or its error; waits when none is queued."""
        event = await self._first(handle)
        while isinstance(event, RequestOutput) and not event.finished:
            try:
                more = handle.events.popleft()
            except IndexError:
                break
            if isinstance(more, Exception):
                self._held = more  # the tokens before it go out first
                break
            event = merged(event, more)
        return event

    async def _first(self, handle: RequestHandle) -> RequestOutput | Exception:
        """The request's next event; waits on the waker, cleared before the queue's last check."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        while True:
            try:
                return handle.events.popleft()
            except IndexError:
                self._waker.event.clear()
            try:
                return handle.events.popleft()
            except IndexError:
                await self._waker.event.wait()

    def close(self) -> None:
        """Abort the request if it has not ended (the client left, or the server stops); frees its KV blocks."""
        if self.handle is not None and not self.done:
            self.done = True
            self.loop.abort(self.handle.request_id, wait=False)
