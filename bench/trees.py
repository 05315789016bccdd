"""Draft trees against chains and target-only on one GPU: tok/s, step time and acceptance per configuration.

Usage (on the GPU machine, from the repo root):
    python bench/trees.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
Every configuration decodes the same prompts greedily (bf16, CUDA graphs): at batch 1 one prompt at a time,
and at the other batch sizes all at once. Prints a table and writes trees_bench.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200 import PROMPTS, decode_run

from cluster.engine import LLMEngine
from workers.builders import DEFAULT_HEAD
from workers.config import MTPServeConfig

CONFIGS = {  # name: speculative settings (None: target-only)
    "target-only": None,
    "chain K=1": {"num_draft_tokens": 1},
    "chain K=2": {"num_draft_tokens": 2},
    "chain K=3": {"num_draft_tokens": 3},
    "tree K=3 N=8 w=3": {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3},
    "tree K=4 N=16 w=4": {"num_draft_tokens": 4, "tree_budget": 16, "tree_width": 4},
    "tree K=5 N=24 w=4": {"num_draft_tokens": 5, "tree_budget": 24, "tree_width": 4},
    "tree K=6 N=32 w=4": {"num_draft_tokens": 6, "tree_budget": 32, "tree_width": 4},
    "tree K=4 N=16 w=4 (eager)": {"num_draft_tokens": 4, "tree_budget": 16, "tree_width": 4},
}
EAGER_SUFFIX = " (eager)"  # the same tree drafting with the captured tree step left out


def build(args: argparse.Namespace, spec: dict[str, int] | None, max_batch: int) -> LLMEngine:
    """A bf16 CUDA-graph engine with the given speculative settings."""
    cfg = MTPServeConfig.from_dict(
        {
            "model": {
                "path": args.model,
                "load_format": args.load_format,
                "device": args.device,
                "dtype": args.dtype,
                "max_model_len": args.max_model_len,
            },
            "scheduler": {"max_num_requests": max_batch, "max_num_batched_tokens": 4096, "prefix_caching": False},
            "speculative": {"enabled": spec is not None, "draft": args.head, **(spec or {"num_draft_tokens": 1})},
        }
    )
    return LLMEngine.from_config(cfg)


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    """decode_run over `prompts`, `batch` at a time; tokens and steps summed, rates recomputed."""
    runs = [decode_run(engine, prompts[i : i + batch], max_tokens) for i in range(0, len(prompts), batch)]
    tokens, steps = sum(r["tokens"] for r in runs), sum(r["steps"] for r in runs)
    seconds = sum(r["tokens"] / r["tok_s"] for r in runs)
    lengths = [r["acceptance_length"] for r in runs if r["acceptance_length"]]
    tree_step = getattr(engine.target, "tree_step", None)
    return {
        "batch": batch,
        "tok_s": tokens / seconds,
        "step_ms": 1e3 * seconds / steps,
        "acceptance_length": sum(lengths) / len(lengths) if lengths else None,
        "tree_steps": None if tree_step is None else tree_step.runs,
        "tree_replays": None if tree_step is None else tree_step.steps.replays,
        "fused_replays": runs[0]["fused_replays"],
        "outputs": [o for r in runs for o in r["outputs"]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model path (the GGUF, or an HF directory); default: SmolLM2")
    ap.add_argument("--head", default=str(DEFAULT_HEAD), help="draft head (default: the shipped one; 'random')")
    ap.add_argument("--load-format", default="auto", help="'dummy' for random weights of the --model config's shape")
    ap.add_argument("--out", default="out", help="directory for trees_bench.json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        engine = build(args, CONFIGS[name], max(batches))
        if name.endswith(EAGER_SUFFIX):
            engine.target.tree_step = None  # type: ignore[attr-defined]
        built = time.perf_counter() - t0
        if engine.tokenizer is None:  # dummy weights: token-id prompts of a chat prompt's length
            prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(40)] for i in range(args.num_prompts)]
        else:
            prompts = [engine.encode_prompt(p) for p in (PROMPTS * 8)[: args.num_prompts]]
        for batch in batches:
            decode_run(engine, prompts[:batch], 8)  # warm-up: first-use kernels compile here
            row = {"config": name, "build_s": built, **measure(engine, prompts, batch, args.max_tokens)}
            outs = row.pop("outputs")
            reference.setdefault(batch, outs)
            row["outputs_equal_target_only"] = sum(a == b for a, b in zip(outs, reference[batch], strict=True)) / len(
                outs
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = {r["batch"]: r["tok_s"] for r in rows if r["config"] == "target-only"}
    for r in rows:
        r["speedup"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python bench/trees.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    (out / "trees_bench.json").write_text(json.dumps(report, indent=2))
    print(f"{'config':<20} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'acc len':>7} {'x target':>8} {'equal':>5}")
    for r in rows:
        acc = f"{r['acceptance_length']:.3f}" if r["acceptance_length"] else "-"
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        print(
            f"{r['config']:<20} {r['batch']:>5} {r['tok_s']:>9.0f} {r['step_ms']:>8.3f} {acc:>7} {sp:>8} "
            f"{r['outputs_equal_target_only']:>5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
