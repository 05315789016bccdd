"""Streaming clients for `bench http-vs-grpc`: `batch` concurrent Generate streams over gRPC, or streamed
`POST /v1/completions` over HTTP, run in this process or split over several client processes so that the
client does not cap what the server can stream."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import aiohttp
import grpc

from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc

START_DELAY_S = 0.5  # client processes start their streams together, this long after the round is handed out


@dataclass
class Stream:
    """One request: when it was sent, its first token came and it ended (wall-clock seconds), and its tokens."""

    sent: float = 0.0
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    chunks: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Job:
    """One client process's share of a round."""

    front_end: str
    addresses: dict[str, str]
    prompts: list[list[int]]
    output_len: int
    channels: int
    start_at: float = 0.0


async def grpc_stream(stub: pb_grpc.InferenceStub, prompt: list[int], output_len: int) -> Stream:
    """One gRPC Generate stream."""
    s = Stream(sent=time.time())
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=output_len, ignore_eos=True)
    )
    try:
        async for msg in stub.Generate(req, timeout=900.0):
            if msg.token_ids and s.first is None:
                s.first = time.time()
            s.tokens += len(msg.token_ids)
            s.chunks += 1
    except grpc.aio.AioRpcError as exc:
        s.error = f"{exc.code().name}: {exc.details()}"
    s.end = time.time()
    return s


async def http_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> Stream:
    """One streamed `POST /v1/completions`, read as server-sent events."""
    s = Stream(sent=time.time())
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            s.error = f"{resp.status}: {await resp.text()}"
            s.end = time.time()
            return s
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                s.error = chunk["error"]["message"]
                break
            n = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
            if n and s.first is None:
                s.first = time.time()
            s.tokens += n
            s.chunks += 1
    s.end = time.time()
    return s


async def _streams(job: Job) -> list[Stream]:
    channels = [
        grpc.aio.insecure_channel(job.addresses["grpc"], options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(job.channels)
    ]
    stubs = [pb_grpc.InferenceStub(c) for c in channels]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=900))
    url = f"http://{job.addresses['http']}/v1/completions"
    try:
        await asyncio.sleep(max(0.0, job.start_at - time.time()))
        if job.front_end == "grpc":
            jobs = [grpc_stream(stubs[i % len(stubs)], p, job.output_len) for i, p in enumerate(job.prompts)]
        else:
            jobs = [http_stream(session, url, p, job.output_len) for p in job.prompts]
        return list(await asyncio.gather(*jobs))
    finally:
        await session.close()
        for c in channels:
            await c.close()


def run_job(job: Job) -> list[Stream]:
    """A client process's streams (also run in this process when there is one client)."""
    return asyncio.run(_streams(job))


class Clients:
    """Runs a round's streams in `procs` client processes (spawned once, kept for every round), or in this
    process when `procs` is 1."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(procs, mp_context=ctx) if procs > 1 else None

    def run(
        self, front_end: str, addresses: dict[str, str], prompts: list[list[int]], output_len: int, channels: int
    ) -> list[Stream]:
        """Every prompt at once over one front end, spread round-robin over the client processes."""
        if self._pool is None:
            return run_job(Job(front_end, addresses, prompts, output_len, channels=channels))
        start_at = time.time() + START_DELAY_S
        shares = [prompts[i :: self.procs] for i in range(self.procs)]
        per = max(1, channels // self.procs)
        jobs = [
            Job(front_end, addresses, share, output_len, channels=per, start_at=start_at) for share in shares if share
        ]
        return [s for streams in self._pool.map(run_job, jobs) for s in streams]

    def close(self) -> None:
        """Stop the client processes."""
        if self._pool is not None:
            self._pool.shutdown()
