"""`mtpserve bench trees`: draft trees against chains and target-only, at any Llama shape.

Every configuration (--configs, names from CONFIGS) decodes the same prompts greedily with CUDA graphs where
the device has them: at batch 1 one prompt at a time, at the other batch sizes all at once. It reports tok/s,
step time, acceptance length, the speed-up over target-only and the share of outputs equal to
target-only's. With --load-format dummy --model DIR (DIR holds only a config.json) it measures the step cost
at a larger shape (say Llama-8B) with random weights; use --draft random there, and read the speed, not the
acceptance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.decode import bench_prompts, decode_run
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig

CONFIGS = {  # name: speculative settings (None: target-only); a fixed kind unless it says adaptive
    "target-only": None,
    "chain K=1": {"num_draft_tokens": 1},
    "chain K=2": {"num_draft_tokens": 2},
    "chain K=3": {"num_draft_tokens": 3},
    "tree K=3 N=8 w=3": {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3},
    "tree K=4 N=16 w=4": {"num_draft_tokens": 4, "tree_budget": 16, "tree_width": 4},
    "tree K=5 N=24 w=4": {"num_draft_tokens": 5, "tree_budget": 24, "tree_width": 4},
    "tree K=6 N=32 w=4": {"num_draft_tokens": 6, "tree_budget": 32, "tree_width": 4},
    "tree K=4 N=16 w=4 (eager)": {"num_draft_tokens": 4, "tree_budget": 16, "tree_width": 4},
    "adaptive K=3": {"num_draft_tokens": 3, "adaptive": True},  # the served default: chain depths 0..3 per step
}
EAGER_SUFFIX = " (eager)"  # the same tree drafting with the captured tree step left out


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench trees`."""
    p = bench_report.add_command(
        kinds,
        "trees",
        "draft trees against chains and target-only: tok/s, step time, acceptance (any Llama shape)",
        __doc__,
    )
    bench_report.add_model_flags(p)
    p.add_argument("--configs", type=config_list, default=list(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--batches", type=bench_report.int_list, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts decoded per configuration and batch size")
    add_draft_vocab_flag(p)
    p.set_defaults(func=main)


def add_draft_vocab_flag(p: argparse.ArgumentParser) -> None:
    """--draft-vocab: a random head's reduced draft vocabulary (speculative.draft_vocab)."""
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="with --draft random: the head scores only the first N token ids (0: all), to time a reduced "
        "draft vocabulary at a shape",
    )


def config_list(text: str) -> list[str]:
    """argparse type: comma-separated configuration names, each one of CONFIGS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    return names


def config(
    args: argparse.Namespace, spec: dict[str, int] | None, max_batch: int, fused_steps: bool = True
) -> MTPServeConfig:
    """The engine config of one configuration (`fused_steps` False: the eager tree, without its captured step)."""
    return MTPServeConfig.from_dict(
        {
            "model": {
                "path": args.model,
                "load_format": args.load_format,
                "device": args.device,
                "dtype": args.dtype,
                "max_model_len": args.max_model_len,
                "fused_steps": fused_steps,
            },
            "scheduler": {"max_num_requests": max_batch, "max_num_batched_tokens": 4096, "prefix_caching": False},
            "speculative": {
                "enabled": spec is not None,
                "draft": args.draft,
                "draft_vocab": vars(args).get("draft_vocab", 0) if spec is not None else 0,
                "adaptive": False,
                **(spec or {"num_draft_tokens": 1}),
            },
        }
    )


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    """decode_run over `prompts`, `batch` at a time; tokens and steps summed, rates recomputed."""
    runs = [decode_run(engine, prompts[i : i + batch], max_tokens) for i in range(0, len(prompts), batch)]
    tokens, steps = sum(r["tokens"] for r in runs), sum(r["steps"] for r in runs)
    seconds = sum(r["tokens"] / r["tok_s"] for r in runs)
    lengths = [r["acceptance_length"] for r in runs if r["acceptance_length"]]
    full_tokens = sum(r["full_tokens"] for r in runs)
    full_s = sum(r["full_s"] for r in runs)
    runner = bench_report.local_runner(engine)
    tree_step = None if runner is None else runner.steps.tree
    return {
        "batch": batch,
        "tok_s": tokens / seconds,
        "step_ms": 1e3 * seconds / steps,
        "full_tok_s": full_tokens / full_s if full_s else None,
        "steps": steps,
        "full_steps": sum(r["full_steps"] for r in runs),
        "acceptance_length": sum(lengths) / len(lengths) if lengths else None,
        "tree_steps": None if tree_step is None else tree_step.runs,
        "tree_replays": None if tree_step is None else tree_step.steps.replays,
        "fused_replays": runs[0]["fused_replays"],
        "outputs": [o for r in runs for o in r["outputs"]],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration at every batch size: the report."""
    rows: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for name in args.configs:
        t0 = time.perf_counter()
        engine = LLMEngine.from_config(
            config(args, CONFIGS[name], max(args.batches), fused_steps=not name.endswith(EAGER_SUFFIX))
        )
        built = time.perf_counter() - t0
        prompts = bench_prompts(engine, args.num_prompts)
        for batch in args.batches:
            decode_run(engine, prompts[:batch], 8)  # warm-up: first-use kernels compile here
            row = {"config": name, "build_s": built, **measure(engine, prompts, batch, args.max_tokens)}
            outs = row.pop("outputs")
            reference.setdefault(batch, outs)
            same = sum(a == b for a, b in zip(outs, reference[batch], strict=True))
            row["outputs_equal_target_only"] = same / len(outs)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        engine.shutdown()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = {r["batch"]: r["tok_s"] for r in rows if r["config"] == "target-only"}
    for r in rows:
        r["speedup"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    settings = {
        "configs": {n: CONFIGS[n] for n in args.configs},
        "batches": args.batches,
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "max_model_len": args.max_model_len,
    }
    cfg = config(args, None, max(args.batches))
    return bench_report.report(
        "trees",
        bench_report.command_of(args),
        cfg=cfg,
        settings=settings,
        results=rows,
        model=args.model,
        load_format=args.load_format,
        draft=args.draft,
    )


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration and batch size."""
    body = [
        [
            r["config"],
            str(r["batch"]),
            f"{r['tok_s']:.0f}",
            f"{r['step_ms']:.3f}",
            f"{r['acceptance_length']:.3f}" if r["acceptance_length"] else "-",
            f"{r['speedup']:.2f}" if r["speedup"] else "-",
            f"{r['outputs_equal_target_only']:.2f}",
        ]
        for r in rows
    ]
    return bench_report.table(["config", "batch", "tok/s", "step ms", "acc len", "x target", "equal"], body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """tok/s against batch size, one line per configuration."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(r["config"], []).append((r["batch"], r["tok_s"]))
    bench_report.plot_lines(path, series, title, "batch size", ylabel="generated tok/s", log_x=True)


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench trees`."""
    return bench_report.run_measurement(args, run, table, plot, title="trees and chains")
