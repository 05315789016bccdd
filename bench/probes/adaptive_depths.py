"""Adaptive speculation on the GPU: serving step time at each forced kind (draft depth, and the draft tree
with --tree-budget) against the start-up timed graph cost, then the adaptive policy itself against
target-only and fixed depths, per batch size.

Usage (on the GPU machine, from the repo root):
    python3 bench/probes/adaptive_depths.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
    python3 bench/probes/adaptive_depths.py --model ... --tree-budget 16 --tree-width 4 --out $OUT
Prints a table last and writes adaptive_depths.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.bench.decode import add_probe_flags, bench_prompts, decode_run, engine_for
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind


def forced(policy: AdaptiveDepth, kind: StepKind) -> AdaptiveDepth:
    """A policy over the same buckets and kinds that always picks `kind` (no exploration)."""
    costs = StepCosts(policy.costs.buckets, policy.max_depth, online=False, trees=policy.costs.trees)
    for b in costs.buckets:
        for other in policy.kinds:
            costs.set(b, other, 1.0 if other == kind else 100.0)
    return AdaptiveDepth(costs, AcceptanceTracker(policy.max_depth), explore_steps=0)


def kind_key(kind: StepKind) -> str:
    """A kind in the report's keys: d<depth> for a chain, tree<budget> for a tree."""
    return str(kind) if kind.is_tree else f"d{kind.depth}"


def row(r: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A decode run without its token lists."""
    return {**{k: v for k, v in r.items() if k != "outputs"}, **extra}


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_flags(ap)
    ap.add_argument("--k", type=int, default=3, help="the deepest draft depth (and the tree's depth)")
    ap.add_argument("--tree-budget", type=int, default=0, help="offer a draft tree of this many nodes too (0: none)")
    ap.add_argument("--tree-width", type=int, default=4, help="the tree's children per expanded node")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per request in every run")
    ap.add_argument(
        "--num-kv-blocks", type=int, default=2048, help="KV blocks: enough that no run at the largest batch preempts"
    )
    ap.add_argument("--out", default="out")
    return ap


def main() -> int:
    """Run every configuration and write the JSON."""
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "gpu": gpu, "runs": []}

    def record(eng: LLMEngine, label: str, depth: int | str | None, tokens: int) -> None:
        for b in batches:
            preempted = eng.scheduler.num_preemptions
            r = decode_run(eng, prompts[:b], tokens)
            r["preemptions"] = eng.scheduler.num_preemptions - preempted
            report["runs"].append(row(r, label=label, depth=depth))
            steps = r.get("steps_per_depth"), r.get("tree_steps")
            print(label, b, f"{r['tok_s']:.0f} tok/s {r['step_ms']:.3f} ms", *steps, flush=True)
        (out / "adaptive_depths.json").write_text(json.dumps(report, indent=2))

    base = engine_for(args, 0, True, top)
    prompts = bench_prompts(base, top)
    decode_run(base, prompts[:2], 8)
    record(base, "target-only", 0, args.max_tokens)
    del base
    for k in (1, args.k):
        eng = engine_for(args, k, True, top)
        decode_run(eng, prompts[:2], 8)
        record(eng, f"fixed K={k}", k, args.max_tokens)
        del eng
    eng = engine_for(args, args.k, True, top, variant="adaptive")
    policy = eng.scheduler.depth
    assert policy is not None
    costs = sorted(policy.costs.seconds.items(), key=lambda kv: (kv[0][0], kv[0][1].num_draft_tokens))
    report["timed_step_ms"] = {f"b{b}/{kind_key(kind)}": 1e3 * c for (b, kind), c in costs}
    decode_run(eng, prompts[:2], 8)
    for kind in policy.kinds:
        eng.scheduler.depth = forced(policy, kind)
        record(eng, f"forced {'depth ' if not kind.is_tree else ''}{kind}", kind_key(kind), args.max_tokens)
    eng.scheduler.depth = policy
    record(eng, "adaptive", None, args.max_tokens)
    print_table(report, batches)
    return 0


def print_table(report: dict[str, Any], batches: list[int]) -> None:
    """tok/s per configuration and batch, with the forced depths' serving step against the timed replay."""
    runs = report["runs"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    print(f"\n{'configuration':<18}" + "".join(f"{b:>10}" for b in batches))
    for label in labels:
        cells = {r["batch"]: r for r in runs if r["label"] == label}
        print(f"{label:<18}" + "".join(f"{cells[b]['tok_s']:>10.0f}" if b in cells else f"{'-':>10}" for b in batches))
    timed = report.get("timed_step_ms", {})
    print("\nforced kind: serving step ms / timed replay ms")
    for r in runs:
        if r["label"].startswith("forced"):
            buckets = [int(k[1:].split("/")[0]) for k in timed]
            bucket = min((b for b in buckets if b >= r["batch"]), default=None)
            t = timed.get(f"b{bucket}/{r['depth']}")
            print(f"  {r['depth']} batch {r['batch']:>3}: {r['step_ms']:.3f} / " + (f"{t:.3f}" if t else "-"))


if __name__ == "__main__":
    sys.exit(main())
