"""The `n` completions of one request (OpenAI's `n`), as one stream of (choice index, piece).

Choice 0 is submitted first and the others once its first piece arrives: by then the prompt's full KV blocks are
in the prefix cache, so the siblings reuse them instead of computing the prompt again. With a seed, choice i
samples with seed + i (as vLLM seeds parallel samples), so each choice equals a single request with that seed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.service.engine_stream import EngineStream, Piece

MAX_CHOICES = 16


def sibling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's sampling settings: the request's, with seed + i for choice i when it has a seed."""
    if params.seed is None:
        return [params] * n
    return [params if i == 0 else params.model_copy(update={"seed": params.seed + i}) for i in range(n)]


class Choices:
    """n EngineStreams of one prompt; `close()` aborts every one that has not ended."""

    def __init__(self, make_stream: Callable[[], EngineStream], n: int) -> None:
        self.streams = [make_stream() for _ in range(n)]
        self._tasks: list[asyncio.Task[None]] = []
        self._prompt: list[int] = []
        self._params: list[SamplingParams] = []
        self._request_id = ""

    async def start(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None) -> None:
        """Submit choice 0 (raising what the engine refuses it with); the others follow its first piece. Without
        a `request_id` the engine names choice 0, and the others take that name with `-i` added."""
        self._prompt = prompt_token_ids
        self._params = sibling_params(params, len(self.streams))
        first_id = request_id if len(self.streams) == 1 or request_id is None else f"{request_id}-0"
        await self.streams[0].start(prompt_token_ids, self._params[0], first_id)
        handle = self.streams[0].handle
        assert handle is not None
        self._request_id = request_id if request_id is not None else handle.request_id

    @property
    def request_id(self) -> str:
        """The request's id (the caller's, or the one the engine gave choice 0); valid after `start`."""
        return self._request_id

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) as each choice's pieces arrive; an engine error of any choice is raised."""
        if len(self.streams) == 1:
            async for piece in self.streams[0].pieces():
                yield 0, piece
            return
        queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()
        first = asyncio.Event()
        self._tasks = [asyncio.create_task(self._pump(i, queue, first)) for i in range(len(self.streams))]
        open_choices = len(self.streams)
        while open_choices:
            index, item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def _pump(
        self, index: int, queue: asyncio.Queue[tuple[int, Piece | BaseException | None]], first: asyncio.Event
    ) -> None:
        stream = self.streams[index]
        try:
            if index > 0:
                await first.wait()
                await stream.start(self._prompt, self._params[index], f"{self._request_id}-{index}")
            async for piece in stream.pieces():
                first.set()
                await queue.put((index, piece))
        except Exception as exc:
            first.set()
            await queue.put((index, exc))
        finally:
            first.set()
            await queue.put((index, None))

    def close(self) -> None:
        """Abort every choice still running and stop reading them."""
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            with contextlib.suppress(Exception):
                stream.close()
