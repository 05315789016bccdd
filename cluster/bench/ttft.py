"""`mtpserve bench ttft`: time to first token by prompt length, alone and while other requests decode.

For each engine (target-only and speculative at each of --ks, the serving configuration) and each prompt
length, it measures the seconds from `add_request` to the request's first token, taken when the server
would deliver it (`LLMEngine.on_tokens`, before the step's draft runs where the draft runs apart; the
captured prefill step drafts inside the same graph): alone on an idle engine (--repeats runs after a
warm-up), and with --busy other requests already decoding (their short prompts prefilled first, `ignore_eos`,
long enough to outlast the measurement). The KV cache holds all of them, so no request is preempted, and
prefix caching is off (each prompt repeats). It also records how many engine steps the prefill took and how
many of them replayed the captured prefill step (`model.prefill_graphs`; --compare-eager-prefill measures
each K without it too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.decode import sync
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig, SchedulerConfig

BUSY_PROMPT = 32  # tokens in each busy request's prompt


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench ttft`."""
    p = bench_report.add_command(
        kinds, "ttft", "time to first token by prompt length, alone and while others decode", __doc__
    )
    bench_report.add_model_flags(p)
    p.add_argument("--lengths", type=bench_report.int_list, default=[128, 512, 2048, 8160], help="prompt tokens")
    p.add_argument("--ks", type=bench_report.depth_list, default=[0, 3], help="draft depths (0: target-only)")
    p.add_argument("--busy", type=int, default=63, help="requests decoding during the busy measurement (0: none)")
    p.add_argument("--busy-tokens", type=int, default=1024, help="max_tokens of each busy request (outlasts a run)")
    p.add_argument("--repeats", type=int, default=3, help="measurements alone per length")
    sched = SchedulerConfig()
    p.add_argument("--chunk-size", type=int, default=sched.chunk_size, help="scheduler.chunk_size")
    p.add_argument(
        "--max-batched-tokens", type=int, default=sched.max_num_batched_tokens, help="scheduler.max_num_batched_tokens"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the measured prompts sample at this temperature with top-p 0.95 (busy ones stay greedy)",
    )
    p.add_argument("--compare-eager-prefill", action="store_true", help="also every K with model.prefill_graphs off")
    p.set_defaults(func=main)


def build(args: argparse.Namespace, k: int, prefill_graphs: bool = True) -> LLMEngine:
    """The serving configuration (`prefill_graphs` off: every prefill step eager), with KV blocks for the
    longest prompt and every busy request at its end (a smaller cache measures preemption, not prefill)."""
    block = 16

    def blocks(n: int) -> int:
        return -(-(n + 2 * k) // block)

    num_blocks = args.busy * blocks(BUSY_PROMPT + args.busy_tokens) + blocks(max(args.lengths) + 1) + 1
    return LLMEngine.from_config(config(args, k, prefill_graphs, num_blocks))


def config(args: argparse.Namespace, k: int, prefill_graphs: bool, num_blocks: int | None = None) -> MTPServeConfig:
    """The engine config of one K."""
    return MTPServeConfig.from_dict(
        {
            "model": {
                "path": args.model,
                "load_format": args.load_format,
                "device": args.device,
                "dtype": args.dtype,
                "max_model_len": max(args.lengths) + 256,
                "prefill_graphs": prefill_graphs,
            },
            "scheduler": {
                "max_num_requests": args.busy + 1,
                "max_num_batched_tokens": args.max_batched_tokens,
                "chunk_size": args.chunk_size,
                "block_size": 16,
                "num_kv_blocks": num_blocks,
                "prefix_caching": False,  # the same prompt repeats: measure its prefill, not a cache hit
            },
            "speculative": {"enabled": k > 0, "draft": args.draft, "num_draft_tokens": max(k, 1), "adaptive": False},
        }
    )


def first_token(engine: LLMEngine, prompt: list[int], temperature: float = 0.0) -> tuple[float, int]:
    """(seconds, engine steps) from add_request to the request's first generated token."""
    sync()
    t0 = time.perf_counter()
    params = {"max_tokens": 1, "ignore_eos": True, "temperature": temperature, "top_p": 0.95 if temperature else 1.0}
    rid = engine.add_request(prompt, params)
    seen: list[float] = []

    def first(outs: list[Any]) -> None:  # as the server's engine loop delivers: before the step's draft runs
        if not seen and any(o.request_id == rid and o.new_token_ids for o in outs):
            seen.append(time.perf_counter())

    engine.on_tokens = first
    steps = 0
    while not seen:
        steps += 1
        first(engine.step())
    engine.on_tokens = None
    return seen[0] - t0, steps


def start_busy(engine: LLMEngine, n: int, max_tokens: int, vocab: int) -> list[str]:
    """n requests of short random prompts, stepped until every one is decoding."""
    g = torch.Generator().manual_seed(0)
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    ids = [engine.add_request(random_ids(BUSY_PROMPT, vocab, g), params) for _ in range(n)]
    reqs = [engine.scheduler.requests[r] for r in ids]
    while any(r.in_context for r in reqs):
        engine.step()
    return ids


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    """n random token ids in [10, min(vocab, 1000))."""
    return torch.randint(10, min(vocab, 1000), (n,), generator=g).tolist()


def prefill_replays(engine: LLMEngine) -> int | None:
    """CUDA-graph replays of the captured prefill step so far (None without one)."""
    runner = bench_report.local_runner(engine)
    return None if runner is None or runner.steps.prefill is None else int(runner.steps.prefill.replays)


def measure(args: argparse.Namespace, k: int, prefill_graphs: bool) -> list[dict[str, Any]]:
    """Rows for one engine: every length, alone and busy."""
    engine = build(args, k, prefill_graphs)
    vocab = engine.args.vocab_size
    tag = {"k": k, "prefill_graphs": prefill_graphs}
    g = torch.Generator().manual_seed(1)
    rows = []
    first_token(engine, random_ids(64, vocab, g))  # warm-up
    for n in args.lengths:
        prompt = random_ids(n, vocab, g)
        first_token(engine, prompt, args.temperature)  # the first prompt of a length pays one-off costs
        before = prefill_replays(engine)
        alone = [first_token(engine, prompt, args.temperature) for _ in range(args.repeats)]
        after = prefill_replays(engine)
        replays = None if before is None or after is None else after - before
        rows.append(
            {
                **tag,
                "prompt_tokens": n,
                "busy": 0,
                "ms": [1e3 * t for t, _ in alone],
                "steps": alone[0][1],
                "prefill_replays": replays,
            }
        )
        if args.busy:
            busy_ids = start_busy(engine, args.busy, args.busy_tokens, vocab)
            t, steps = first_token(engine, prompt, args.temperature)
            rows.append({**tag, "prompt_tokens": n, "busy": args.busy, "ms": [1e3 * t], "steps": steps})
            for r in busy_ids:
                engine.abort(r)
            while engine.has_unfinished():
                engine.step()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    engine.shutdown()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every K (with and without captured prefill if asked): the report."""
    modes = [True, False] if args.compare_eager_prefill else [True]
    rows = [row for k in args.ks for graphs in modes for row in measure(args, k, graphs)]
    settings = bench_report.settings_of(args, SETTINGS)
    return bench_report.report(
        "ttft",
        bench_report.command_of(args),
        cfg=config(args, 0, True),
        settings=settings,
        results=rows,
        model=args.model,
        draft=args.draft,
    )


SETTINGS = (
    "lengths",
    "ks",
    "busy",
    "busy_tokens",
    "repeats",
    "chunk_size",
    "max_batched_tokens",
    "temperature",
    "compare_eager_prefill",
    "max_model_len",
)


def table(rows: list[dict[str, Any]]) -> str:
    """TTFT per K, prefill mode, prompt length and load."""
    body = [
        [
            str(r["k"]),
            "on" if r["prefill_graphs"] else "off",
            str(r["prompt_tokens"]),
            str(r["busy"]),
            " / ".join(f"{x:.1f}" for x in r["ms"]),
            str(r["steps"]),
            str(r.get("prefill_replays", "-")),
        ]
        for r in rows
    ]
    return bench_report.table(["K", "prefill graphs", "prompt", "busy", "TTFT ms (each)", "steps", "replays"], body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Median TTFT alone against prompt length, one line per K and prefill mode."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["busy"] == 0:
            name = f"K={r['k']}" + ("" if r["prefill_graphs"] else ", eager prefill")
            series.setdefault(name, []).append((r["prompt_tokens"], sorted(r["ms"])[len(r["ms"]) // 2]))
    bench_report.plot_lines(path, series, title, "prompt tokens", ylabel="TTFT alone, ms (median)", log_x=True)


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench ttft`."""
    return bench_report.run_measurement(args, run, table, plot, title="TTFT")
