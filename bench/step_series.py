"""Step time along a long decode: mean wall ms per window of steps, for target-only and for the depth-0
fused step of adaptive speculation (the same target forward plus the draft's KV write), at one batch size.

Usage (on the GPU machine, from the repo root):
    python bench/step_series.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
Writes step_series.json under --out and prints one row per window.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_depths import forced
from h200 import PROMPTS, engine_for, sync

from cluster.engine import LLMEngine
from workers.builders import DEFAULT_HEAD


def series(eng: LLMEngine, prompts: list[list[int]], tokens: int) -> list[float]:
    """Wall ms of every generation step of one batch decoding `tokens` tokens per request."""
    ids = [eng.add_request(p, {"max_tokens": tokens, "ignore_eos": True}) for p in prompts]
    reqs = [eng.scheduler.requests[r] for r in ids]
    while any(r.in_context for r in reqs):
        eng.step()
    sync()
    out = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        out.append(1e3 * (time.perf_counter() - t0))
    sync()
    return out


def main() -> int:
    """Both configurations, then the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default=str(DEFAULT_HEAD))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "series_ms": {}}
    base = engine_for(args, 0, True, args.batch)
    prompts = [base.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    report["prompt_tokens"] = [len(p) for p in prompts]
    series(base, prompts[:2], 8)
    report["series_ms"]["target-only"] = series(base, prompts, args.max_tokens)
    del base
    torch.cuda.empty_cache()
    plain = engine_for(args, 0, True, args.batch, variant="no-overlap")
    series(plain, prompts[:2], 8)
    report["series_ms"]["no-overlap"] = series(plain, prompts, args.max_tokens)
    del plain
    eng = engine_for(args, 3, True, args.batch, variant="adaptive")
    assert eng.scheduler.depth is not None
    eng.scheduler.depth = forced(eng.scheduler.depth, 0)
    series(eng, prompts[:2], 8)
    report["series_ms"]["depth 0"] = series(eng, prompts, args.max_tokens)
    (out / "step_series.json").write_text(json.dumps(report, indent=2))
    names = list(report["series_ms"])
    print(f"{'steps':>10}" + "".join(f"{n:>14}" for n in names))
    n = min(len(v) for v in report["series_ms"].values())
    for start in range(0, n, args.window):
        cells = [
            sum(v[start : start + args.window]) / len(v[start : start + args.window])
            for v in report["series_ms"].values()
        ]
        print(f"{start:>5}-{start + args.window - 1:<4}" + "".join(f"{c:>14.3f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
