"""Per-step timings of `mtpserve bench prefix-cache`'s concurrent first turns, to explain slow steps.

Builds the benchmark's cached engine, runs its warm-up, then the concurrent first turns three times
(the cache emptied before each) and logs every step: wall ms, the plan's context rows and tokens,
generation rows, and how many Triton kernels were compiled during the step (files added to a fresh
TRITON_CACHE_DIR). Writes prefix_steps.json under --out.

    python3 bench/prefix_steps.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

cache_dir = tempfile.mkdtemp(prefix="triton-")
os.environ["TRITON_CACHE_DIR"] = cache_dir
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cluster import bench_prefix  # noqa: E402
from cluster.build import build_engine  # noqa: E402
from cluster.engine import LLMEngine  # noqa: E402
from modeling.loader import resolve_model  # noqa: E402
from workers.builders import DEFAULT_HEAD  # noqa: E402
from workers.config import MTPServeConfig  # noqa: E402


def compiled() -> int:
    """Kernels in the fresh Triton cache so far."""
    return len(os.listdir(cache_dir))


def kernel_names(dirs: set[str]) -> list[str]:
    """Names of the kernels compiled into these cache folders (one folder per compiled variant)."""
    return sorted(f.stem for d in dirs for f in (Path(cache_dir) / d).glob("*.cubin"))


def logged_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, log: list[dict[str, Any]]) -> float:
    """run_batch with a record per step; returns the wall seconds."""
    plans: list[Any] = []
    original = engine.scheduler.schedule

    def schedule() -> Any:
        plan = original()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, {"max_tokens": max_tokens})
    while engine.has_unfinished():
        before, n = compiled(), len(plans)
        s0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - s0)
        plan = plans[-1] if len(plans) > n else None
        ctx = [s for s in plan.seqs if s.is_context] if plan else []
        log.append(
            {
                "ms": round(ms, 2),
                "planned": plan is not None,
                "ctx_rows": len(ctx),
                "ctx_tokens": sum(len(s.token_ids) for s in ctx),
                "ctx_starts": [s.start for s in ctx],
                "gen_rows": len(plan.seqs) - len(ctx) if plan else None,
                "compiles": compiled() - before,
            }
        )
    engine.scheduler.schedule = original  # type: ignore[method-assign]
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    cfg = MTPServeConfig.from_dict(
        {"model": {"path": args.model, "device": "cuda"}, "speculative": {"draft": str(DEFAULT_HEAD)}}
    )
    tok = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir).tokenizer()
    document, warm_doc = bench_prefix.load_documents(list(bench_prefix.DEFAULT_DOCUMENTS), tok, args.prefix_len)
    convs = bench_prefix.conversations(document, args.conversations)
    warm = bench_prefix.conversations(warm_doc, args.conversations)
    longest = len(bench_prefix.chat_ids(tok, convs[0], 1)) + 2 * args.max_tokens + 32
    engine = build_engine(bench_prefix.bench_config(cfg, args.conversations, longest, args.max_tokens))
    report: dict[str, Any] = {"command": " ".join(sys.argv), "after_build_compiles": compiled(), "passes": []}
    built = set(os.listdir(cache_dir))
    warm_log: list[dict[str, Any]] = []
    t = logged_batch(engine, [bench_prefix.chat_ids(tok, c, 1) for c in warm], args.max_tokens, warm_log)
    report["passes"].append({"name": "warm-up document", "wall_s": t, "steps": warm_log})
    for i in range(3):
        engine.scheduler.forget_cached()
        log: list[dict[str, Any]] = []
        t = logged_batch(engine, [bench_prefix.chat_ids(tok, c, 1) for c in convs], args.max_tokens, log)
        report["passes"].append({"name": f"document, pass {i + 1}", "wall_s": t, "steps": log})
    engine.shutdown()
    report["compiled_while_serving"] = kernel_names(set(os.listdir(cache_dir)) - built)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_steps.json").write_text(json.dumps(report, indent=1) + "\n")
    for p in report["passes"]:
        slow = [s for s in p["steps"] if s["ms"] > 40 or s["compiles"]]
        n_compiles = sum(s["compiles"] for s in p["steps"])
        print(f"{p['name']}: {p['wall_s'] * 1e3:.0f} ms, {len(p['steps'])} steps, compiles {n_compiles}")
        for s in slow[:12]:
            print("   ", json.dumps(s))
    print("kernel variants compiled after the engine was built:", report["compiled_while_serving"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
