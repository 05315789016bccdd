"""Closed-loop streaming clients for `bench serve`: each client process keeps its share of the streams busy
(a stream that ends is replaced at once by a new request) over the official `openai` client (HTTP) or grpc.aio
(gRPC), and reports what arrived inside one measured window of wall time."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

START_DELAY_S = 1.0  # client processes start together, this long after the jobs are handed out
STREAMS_PER_CONNECTION = 4  # gRPC streams one connection carries (HTTP opens one per concurrent request)


@dataclass(frozen=True)
class LoopJob:
    """One client process's share: `streams` concurrent streams over one front end, from `start_at` (wall clock)
    to `end_at`, counting what arrives in [measure_from, end_at)."""

    front_end: str  # "http" or "grpc"
    address: str  # host:port
    streams: int
    prompts: list[list[int]]  # drawn in turn for each new request
    output_len: int
    start_at: float
    measure_from: float
    end_at: float
    api_key: str = "unused"


@dataclass
class LoopResult:
    """What one client process saw inside the window."""

    tokens: int = 0
    chunks: int = 0
    requests: int = 0  # requests finished inside the window
    ttft_ms: list[float] = field(default_factory=list)  # requests sent inside the window
    itl_ms: list[float] = field(default_factory=list)  # per token: gap between chunks over the chunk's tokens
    life_ms: list[float] = field(default_factory=list)  # sent to stream end, requests sent and ended inside
    tail_ms: list[float] = field(default_factory=list)  # last token's chunk to stream end (usage, [DONE]), same
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0  # this process's CPU time over the window

    def merge(self, other: LoopResult) -> None:
        """Add another process's results to these."""
        self.tokens += other.tokens
        self.chunks += other.chunks
        self.requests += other.requests
        self.ttft_ms += other.ttft_ms
        self.itl_ms += other.itl_ms
        self.life_ms += other.life_ms
        self.tail_ms += other.tail_ms
        self.errors += other.errors
        self.cpu_s += other.cpu_s


class Recorder:
    """Turns one stream's chunk arrivals into the window's counts."""

    def __init__(self, job: LoopJob, out: LoopResult) -> None:
        self.job, self.out = job, out

    def request(self) -> Stream:
        """The recorder of one request, sent now."""
        return Stream(self.job, self.out, time.time())


@dataclass
class Stream:
    """One request's arrivals: `chunk` with each chunk's token count as it arrives, `end` when the stream ends."""

    job: LoopJob
    out: LoopResult
    sent: float
    last: float = 0.0  # when the last chunk with tokens arrived (0: none yet)

    def chunk(self, n: int) -> None:
        """A chunk of `n` tokens arrived (chunks without tokens count only at the end)."""
        now = time.time()
        if not n:
            return
        inside = self.job.measure_from <= now < self.job.end_at
        if not self.last and inside and self.sent >= self.job.measure_from:
            self.out.ttft_ms.append(1e3 * (now - self.sent))
        elif self.last and inside:
            self.out.itl_ms.extend([1e3 * (now - self.last) / n] * n)
        if inside:
            self.out.tokens += n
            self.out.chunks += 1
        self.last = now

    def end(self) -> None:
        """The stream ended whole."""
        now = time.time()
        if self.job.measure_from <= self.sent and now < self.job.end_at and self.last:
            self.out.life_ms.append(1e3 * (now - self.sent))
            self.out.tail_ms.append(1e3 * (now - self.last))


async def http_loop(job: LoopJob, rec: Recorder) -> None:
    """Streams over the official openai client (AsyncOpenAI, streamed completions with token ids)."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=job.streams + 8, max_keepalive_connections=job.streams + 8)
    async with openai.AsyncOpenAI(
        base_url=f"http://{job.address}/v1",
        api_key=job.api_key,
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    ) as client:
        model = (await client.models.list()).data[0].id

        async def one(prompt: list[int], rec: Stream) -> None:
            stream: Any = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=job.output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            async for c in stream:
                rec.chunk(sum(len(getattr(ch, "token_ids", None) or []) for ch in c.choices))
            rec.end()

        await run_streams(job, rec, one)


async def grpc_loop(job: LoopJob, rec: Recorder) -> None:
    """Streams over grpc.aio Generate calls, a connection per STREAMS_PER_CONNECTION streams (a server's front-end
    processes share its port, and each connection stays with the process that accepted it: with a few, some front
    ends would sit idle while others saturate)."""
    import grpc

    from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
    from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc

    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, not one shared with the others
    n = -(-job.streams // STREAMS_PER_CONNECTION)
    channels = [grpc.aio.insecure_channel(job.address, options=own) for _ in range(max(1, n))]
    stubs = [pb_grpc.InferenceStub(c) for c in channels]
    turn = [0]

    async def one(prompt: list[int], rec: Stream) -> None:
        turn[0] += 1
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=job.output_len, ignore_eos=True),
        )
        async for msg in stubs[turn[0] % len(stubs)].Generate(req, timeout=600.0):
            rec.chunk(len(msg.token_ids))
        rec.end()

    try:
        await run_streams(job, rec, one)
    finally:
        for c in channels:
            await c.close()


async def run_streams(job: LoopJob, rec: Recorder, one: Callable[[list[int], Stream], Awaitable[None]]) -> None:
    """`job.streams` workers, each sending a new request as soon as its last one ends, until the window ends."""
    prompts = iter(job.prompts * (1 + 10_000 // max(1, len(job.prompts))))

    async def worker() -> None:
        while time.time() < job.end_at:
            try:
                await one(next(prompts), rec.request())
                if job.measure_from <= time.time() < job.end_at:
                    rec.out.requests += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                rec.out.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.05)

    await asyncio.sleep(max(0.0, job.start_at - time.time()))
    workers = [asyncio.create_task(worker()) for _ in range(job.streams)]
    await asyncio.sleep(max(0.0, job.measure_from - time.time()))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, job.end_at - time.time()))
    rec.out.cpu_s = time.process_time() - cpu0
    for w in workers:
        w.cancel()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), timeout=30)


def run_job(job: LoopJob) -> LoopResult:
    """A client process's closed loop (also run in the calling process when there is one client)."""
    out = LoopResult()
    loop = http_loop if job.front_end == "http" else grpc_loop
    asyncio.run(loop(job, Recorder(job, out)))
    return out


class LoopClients:
    """Client processes, spawned once and kept for every measurement."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))

    def run(
        self,
        front_end: str,
        address: str,
        streams: int,
        prompts: list[list[int]],
        output_len: int,
        warmup_s: float,
        window_s: float,
        *,
        api_key: str = "unused",
        at_window: Callable[[], None] | None = None,
    ) -> LoopResult:
        """`streams` closed-loop streams spread over the client processes: a warm-up, then the measured window.
        `at_window` is called (from a timer thread) as the window opens and again as it closes, so that readings
        of the server span the same window as the clients' counts."""
        procs = min(self.procs, streams)
        start = time.time() + START_DELAY_S
        jobs = []
        for i in range(procs):
            n = streams // procs + (i < streams % procs)
            share = prompts[i::procs] or prompts
            jobs.append(
                LoopJob(
                    front_end,
                    address,
                    n,
                    share,
                    output_len=output_len,
                    start_at=start,
                    measure_from=start + warmup_s,
                    end_at=start + warmup_s + window_s,
                    api_key=api_key,
                )
            )
        timers = []
        if at_window is not None:
            for at in (start + warmup_s, start + warmup_s + window_s):
                timers.append(threading.Timer(max(0.0, at - time.time()), at_window))
                timers[-1].start()
        total = LoopResult()
        try:
            for r in self._pool.map(run_job, jobs):
                total.merge(r)
        finally:
            for t in timers:
                t.join()
        return total

    def close(self) -> None:
        """Stop the client processes."""
        self._pool.shutdown()
