"""The project's engine as a draft-dataset generator for `mtpserve train-draft` (`--generator engine`).

It lives in the cluster layer because it drives an LLMEngine; speculative/train/ sees it only as a
`Generator` passed in by the caller.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train.generators import GenResult, GenSettings
from mtpserve.workers.config import MTPServeConfig


class EngineGenerator:
    """The in-process LLMEngine with speculation off (CUDA graphs and overlapped steps on CUDA).

    Requests are admitted in waves: new ones join only when the running batch has shrunk to `refill` of
    `batch_size`, so most steps are pure decoding steps (captured and overlapped) rather than steps that
    mix a prompt chunk into the batch, which run eagerly.
    """

    name = "engine"

    def __init__(
        self,
        args: LlamaArgs,
        weights: dict[str, torch.Tensor],
        device: str,
        dtype: str,
        batch_size: int,
        max_len: int,
        refill: float = 0.5,
    ) -> None:
        max_len = min(max_len, args.max_position_embeddings)
        block = 16
        cfg = MTPServeConfig.from_dict(
            {},
            {
                "model.device": device,
                "model.dtype": dtype,
                "model.max_model_len": max_len,
                "speculative.enabled": False,
                "scheduler.max_num_requests": batch_size,
                "scheduler.max_num_batched_tokens": max(8192, 2 * max_len),
                "scheduler.chunk_size": max_len,
                "scheduler.block_size": block,
                "scheduler.num_kv_blocks": batch_size * (-(-(max_len + 1) // block)) + 1,
                "scheduler.max_queue": max(1024, 2 * batch_size),
            },
        )
        self.engine = LLMEngine.from_weights(cfg, args, weights)
        self.batch_size = batch_size
        self.max_len = max_len
        self.low_water = int(refill * batch_size)
        self.tokens_generated = 0
        self.busy_s = 0.0

    def generate(self, prompts: list[list[int]], settings: GenSettings, desc: str = "") -> list[GenResult]:
        """Continuous batching over all prompts in waves, one seed per request (seed + index)."""
        eng = self.engine
        stop = sorted(settings.stop_ids)
        pending = list(enumerate(prompts))[::-1]
        owner: dict[str, int] = {}
        tokens: dict[int, list[int]] = {}
        results: list[GenResult | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        with tqdm(total=len(prompts), desc=desc or "generate (engine)", unit="seq", leave=False) as bar:
            while pending or eng.has_unfinished():
                in_flight = eng.scheduler.num_waiting + eng.scheduler.num_running
                if pending and in_flight <= self.low_water:
                    while pending and in_flight < self.batch_size:
                        i, p = pending.pop()
                        room = self.max_len - len(p)
                        if room < 1:
                            results[i] = GenResult([], "length")
                            bar.update(1)
                            continue
                        params = {
                            "max_tokens": min(settings.max_new_tokens, room),
                            "temperature": settings.temperature,
                            "top_p": settings.top_p,
                            "seed": settings.seed + i,
                            "stop_token_ids": stop,
                        }
                        owner[eng.add_request(p, params)] = i
                        tokens[i] = []
                        in_flight += 1
                for o in eng.step():
                    i = owner[o.request_id]
                    tokens[i].extend(o.new_token_ids)
                    self.tokens_generated += len(o.new_token_ids)
                    if o.finished:
                        results[i] = GenResult(tokens.pop(i), o.finish_reason or "length")
                        bar.update(1)
        self.busy_s += time.perf_counter() - t0
        return [r if r is not None else GenResult([], "length") for r in results]
