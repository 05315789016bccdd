"""openai-client streams for the service tests: a plan of chat and text streams (greedy and sampled, some
closed mid-stream) and one round of them all at once."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

STREAMS = 256
MAX_TOKENS = 6
CANCELLED_MAX_TOKENS = 300  # streams closed after their first tokens ask for many more


@dataclass
class Spec:
    """One planned stream."""

    chat: bool
    prompt: list[int] | str
    sampling: dict[str, Any]
    cancel: bool


@dataclass
class Outcome:
    """What one stream received."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    usage: Any = None
    closed_early: bool = False


def plan(seed: int, streams: int = STREAMS) -> list[Spec]:
    """A quarter chat, the rest text completions of random token ids; half greedy, half sampled; 1 in 8 closed
    after its first tokens (and asking for CANCELLED_MAX_TOKENS, so that it is cut mid-stream)."""
    rng = random.Random(seed)
    specs = []
    for i in range(streams):
        sampling: dict[str, Any] = {"temperature": 0.0}
        if i % 2:
            sampling = {"temperature": 0.8, "top_p": 0.9, "seed": i}
        prompt: list[int] | str = [rng.randrange(10, 49152) for _ in range(rng.choice([3, 9, 17, 30]))]
        if i % 4 == 0:
            prompt = f"Question {i}: what comes after {rng.randrange(1000)}?"
        specs.append(Spec(i % 4 == 0, prompt, sampling, rng.random() < 0.125))
    return specs


async def run_stream(client: openai.AsyncOpenAI, model: str, spec: Spec, go: asyncio.Event) -> Outcome:
    """One stream; a planned cancel closes it after the first chunk that carries tokens."""
    out = Outcome()
    extra = {"ignore_eos": True, "return_token_ids": True}
    max_tokens = CANCELLED_MAX_TOKENS if spec.cancel else MAX_TOKENS
    kw: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True, "extra_body": extra}
    kw |= {"stream_options": {"include_usage": True}, **spec.sampling}
    await go.wait()
    if spec.chat:
        stream: Any = await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=spec.prompt, **kw)
    async for chunk in stream:
        if chunk.usage is not None:
            out.usage = chunk.usage
        for choice in chunk.choices:
            out.tokens.extend(choice.token_ids)
            out.text += (choice.delta.content or "") if spec.chat else choice.text
            out.finish = choice.finish_reason or out.finish
        if spec.cancel and out.tokens:
            await stream.close()
            out.closed_early = True
            break
    return out


async def one_round(base_url: str, model: str, specs: list[Spec], api_key: str = "unused") -> list[Outcome]:
    """Every stream at once over one client whose pool holds a connection per stream."""
    limits = httpx2.Limits(max_connections=len(specs) + 16, max_keepalive_connections=len(specs) + 16)
    http_client = openai.DefaultAsyncHttpxClient(limits=limits)
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=180, http_client=http_client
    ) as client:
        go = asyncio.Event()
        tasks = [asyncio.create_task(run_stream(client, model, s, go)) for s in specs]
        go.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
