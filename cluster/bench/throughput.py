"""`mtpserve bench throughput`: decode throughput of concurrent requests.

N requests of random prompt tokens are added at once and stepped to completion (greedy, `ignore_eos`,
fixed output length). The *prefill phase* runs from the start until every request has its first token
(it includes steps that mix late prompt chunks with early requests' decodes); the *decode phase* is every
step after that, when all rows are generation rows. The engine comes from the caller, so tests can run
this on tiny in-memory models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mtpserve.cluster.bench.report import BenchError, environment, model_info, table, with_sections
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.loader import resolve_device
from mtpserve.speculative.stats import SpecStats
from mtpserve.workers.builders import num_blocks_for
from mtpserve.workers.config import MTPServeConfig


@dataclass
class ThroughputRow:
    """One batch size's measurement. Times in seconds unless the name says ms."""

    batch_size: int
    prompt_len: int
    output_len: int
    steps: int
    prefill_s: float  # start -> every request has its first token
    ttft_mean_s: float
    ttft_max_s: float
    decode_steps: int
    decode_s: float
    decode_step_ms: float  # mean wall time of one decode-phase step
    decode_tok_s: float  # tokens emitted in the decode phase / decode_s
    output_tok_s: float  # all output tokens / total_s
    total_s: float
    output_tokens: int
    preemptions: int
    acceptance_rate: float | None = None
    acceptance_length: float | None = None


def random_token_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`n` reproducible prompts of `length` uniformly random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


def throughput_config(
    cfg: MTPServeConfig,
    batch_sizes: Sequence[int],
    prompt_len: int,
    output_len: int,
    size_slots: bool = True,
    size_cache: bool = True,
) -> MTPServeConfig:
    """Make room for the largest batch: enough request slots and KV blocks to run it without preemption.

    `size_slots` / `size_cache` are False when the user set --max-num-requests / --num-kv-blocks.
    """
    sched = cfg.scheduler
    largest = max(batch_sizes)
    update: dict[str, Any] = {}
    if size_slots and sched.max_num_requests < largest:
        update["max_num_requests"] = largest
    if size_cache:
        spec = cfg.speculative
        extra = spec.proposed_tokens + spec.scratch_slots if spec.enabled else 0
        per_request = math.ceil((prompt_len + output_len + extra + 1) / sched.block_size)
        need = largest * per_request + 1
        if need > num_blocks_for(with_sections(cfg, scheduler=update), prompt_len + output_len):
            update["num_kv_blocks"] = need
    return with_sections(cfg, scheduler=update) if update else cfg


def warm_up(engine: LLMEngine, prompt_len: int, steps: int, seed: int = 2**31 - 1) -> None:
    """Run one throw-away request for `steps` engine steps (allocator, kernels, caches)."""
    if steps <= 0:
        return
    (prompt,) = random_token_prompts(1, prompt_len, engine.args.vocab_size, seed)
    rid = engine.add_request(prompt, {"max_tokens": steps, "ignore_eos": True})
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.abort(rid)
    _sync(engine)


def _sync(engine: LLMEngine) -> None:
    dev = resolve_device(engine.cfg.model.device)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def measure_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> ThroughputRow:
    """Run `prompts` concurrently to `output_len` tokens each and time the prefill and decode phases."""
    params = {"max_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    preempted_before = engine.scheduler.num_preemptions
    _sync(engine)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    produced = dict.fromkeys(ids, 0)
    stats = SpecStats()
    steps = decode_steps = decode_tokens = 0
    prefill_end = t0
    while engine.has_unfinished():
        in_decode = len(first) == len(ids)
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        emitted = 0
        for o in outputs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
            produced[o.request_id] += len(o.new_token_ids)
            emitted += len(o.new_token_ids)
            if o.finished:
                stats.merge(o.stats)
        if in_decode:
            decode_steps += 1
            decode_tokens += emitted
        elif len(first) == len(ids):
            prefill_end = now
    _sync(engine)
    total = time.perf_counter() - t0
    decode_s = total - (prefill_end - t0)
    ttft = list(first.values())
    spec = stats.verify_steps > 0
    return ThroughputRow(
        batch_size=len(prompts),
        prompt_len=len(prompts[0]),
        output_len=output_len,
        steps=steps,
        prefill_s=prefill_end - t0,
        ttft_mean_s=sum(ttft) / len(ttft),
        ttft_max_s=max(ttft),
        decode_steps=decode_steps,
        decode_s=decode_s,
        decode_step_ms=1000 * decode_s / decode_steps if decode_steps else 0.0,
        decode_tok_s=decode_tokens / decode_s if decode_steps and decode_s > 0 else 0.0,
        output_tok_s=sum(produced.values()) / total,
        total_s=total,
        output_tokens=sum(produced.values()),
        preemptions=engine.scheduler.num_preemptions - preempted_before,
        acceptance_rate=stats.acceptance_rate if spec else None,
        acceptance_length=stats.acceptance_length if spec else None,
    )


def run_throughput(
    engine: LLMEngine,
    batch_sizes: Sequence[int],
    prompt_len: int,
    output_len: int,
    warmup_steps: int = 3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[ThroughputRow]:
    """Measure each batch size in turn on one engine (warmed up once)."""
    if prompt_len <= 0 or output_len <= 0 or not batch_sizes or min(batch_sizes) <= 0:
        raise BenchError("prompt length, output length and batch sizes must be positive")
    warm_up(engine, prompt_len, warmup_steps)
    rows = []
    for i, bs in enumerate(batch_sizes):
        prompts = random_token_prompts(bs, prompt_len, engine.args.vocab_size, seed + i)
        rows.append(measure_batch(engine, prompts, output_len))
        if log is not None:
            r = rows[-1]
            log(f"batch {bs}: {r.decode_tok_s:.1f} decode tok/s, {r.decode_step_ms:.1f} ms/step, {r.total_s:.1f}s")
    return rows


def throughput_report(
    cfg: MTPServeConfig,
    engine: LLMEngine,
    rows: list[ThroughputRow],
    settings: dict[str, Any],
    command: str,
) -> dict[str, Any]:
    """The JSON document of a throughput run."""
    return {
        "benchmark": "throughput",
        "command": command,
        **environment(cfg),
        "model": model_info(cfg, engine.args),
        "speculation": _speculation(cfg, engine),
        "scheduler": cfg.scheduler.model_dump(),
        "settings": settings,
        "phases": "prefill = start until every request has its first token (may include mixed steps); "
        "decode = every step after that",
        "results": [asdict(r) for r in rows],
    }


def _speculation(cfg: MTPServeConfig, engine: LLMEngine) -> dict[str, Any]:
    on = engine.draft is not None
    spec = cfg.speculative
    return {
        "enabled": on,
        "draft": spec.draft if on else None,
        "num_draft_tokens": spec.num_draft_tokens if on else 0,
        "lookahead_source": spec.lookahead_source,
    }


def format_throughput_table(rows: list[ThroughputRow]) -> str:
    """A fixed-width table, one row per batch size."""
    head = ["batch", "decode tok/s", "step ms", "prefill s", "TTFT mean s", "TTFT max s", "out tok/s", "total s"]
    body = [
        [
            str(r.batch_size),
            f"{r.decode_tok_s:.1f}",
            f"{r.decode_step_ms:.1f}",
            f"{r.prefill_s:.2f}",
            f"{r.ttft_mean_s:.2f}",
            f"{r.ttft_max_s:.2f}",
            f"{r.output_tok_s:.1f}",
            f"{r.total_s:.1f}",
        ]
        for r in rows
    ]
    if any(r.acceptance_length is not None for r in rows):
        head.append("acc len")
        for line, r in zip(body, rows, strict=True):
            line.append("-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}")
    return table(head, body)


def plot_throughput(rows: list[ThroughputRow], path: str | Path, title: str = "") -> None:
    """Decode tok/s and step time against batch size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [r.batch_size for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(bs, [r.decode_tok_s for r in rows], marker="o")
    a.set(xscale="log", xlabel="batch size", ylabel="decode tok/s")
    b.plot(bs, [r.decode_step_ms for r in rows], marker="o", color="tab:orange")
    b.set(xscale="log", xlabel="batch size", ylabel="decode step (ms)")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
