"""A soak of the HTTP API through the official openai client: concurrent workers that, until a deadline, send greedy
streams, close streams mid-way, send bad requests and oversized prompts; records how every request ended."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

PROMPTS = [[100 + 37 * i + j for j in range(5 + 3 * i)] for i in range(8)]
LENGTHS = (8, 16)
TERMINAL = {"finished", "error event", "refused", "closed by client"}


@dataclass
class SoakReport:
    """How the requests ended ('cut' is a stream that ended without a terminal status) and the tokens of each
    greedy stream that finished, by (prompt index, max_tokens)."""

    ends: Counter[str] = field(default_factory=Counter)
    cuts: list[str] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    completed: dict[tuple[int, int], list[list[int]]] = field(default_factory=dict)


async def _greedy(client: openai.AsyncOpenAI, model: str, key: tuple[int, int], close_after_first: bool) -> Any:
    """One greedy stream; returns (how it ended, its tokens)."""
    tokens: list[int] = []
    finish = None
    stream: Any = await client.completions.create(
        model=model,
        prompt=PROMPTS[key[0]],
        max_tokens=200 if close_after_first else key[1],
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            tokens.extend(choice.token_ids or [])
            finish = choice.finish_reason or finish
        if close_after_first and tokens:
            await stream.close()
            return "closed by client", tokens
    return ("finished" if finish == "length" else f"cut: finish {finish!r}"), tokens


async def _bad(client: openai.AsyncOpenAI, model: str, kind: str, max_model_len: int) -> str:
    if kind == "oversized":
        await client.completions.create(model=model, prompt="word " * (max_model_len + 50), max_tokens=4)
    else:
        await client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=-1.0)
    return "cut: a bad request was served"


async def _worker(
    client: openai.AsyncOpenAI, model: str, rng: random.Random, deadline: float, max_model_len: int, rep: SoakReport
) -> None:
    while time.monotonic() < deadline:
        r = rng.random()
        key = (rng.randrange(len(PROMPTS)), rng.choice(LENGTHS))
        try:
            if r < 0.1:
                end = await _bad(client, model, "oversized" if r < 0.05 else "temperature", max_model_len)
            else:
                end, tokens = await _greedy(client, model, key, close_after_first=r < 0.25)
                if end == "finished":
                    rep.completed.setdefault(key, []).append(tokens)
        except openai.APIStatusError as exc:  # refused with a status before the stream began
            end = "refused"
            rep.refusals[f"{exc.status_code} {str(exc.message)[:60]}"] += 1
        except openai.APIError as exc:  # an error event in the stream
            end = "error event" if exc.message else f"cut: {exc!r}"
        except Exception as exc:  # the connection dropped without a status
            end = f"cut: {type(exc).__name__}: {exc}"
        if end.startswith("cut"):
            rep.cuts.append(end)
            end = "cut"
        rep.ends[end] += 1


async def soak(
    base_url: str,
    model: str,
    seconds: float,
    max_model_len: int,
    streams: int = 64,
    seed: int = 0,
    midway: Callable[[], None] | None = None,
) -> SoakReport:
    """`streams` workers for `seconds`; `midway` runs (in a thread) halfway through."""
    rep = SoakReport()
    limits = httpx2.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    async with openai.AsyncOpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    ) as client:
        deadline = time.monotonic() + seconds
        work = [
            asyncio.create_task(_worker(client, model, random.Random(seed * 1000 + i), deadline, max_model_len, rep))
            for i in range(streams)
        ]
        if midway is not None:
            await asyncio.sleep(seconds / 2)
            await asyncio.to_thread(midway)
        await asyncio.wait_for(asyncio.gather(*work), timeout=seconds + 180)
    return rep


def references(base_url: str, model: str, keys: list[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Each (prompt, max_tokens) alone, one request at a time."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    out = {}
    for p, n in keys:
        done = client.completions.create(
            model=model,
            prompt=PROMPTS[p],
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        out[(p, n)] = list(done.choices[0].token_ids)
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for {pid}")
