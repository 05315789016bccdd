"""Distributed path vs in-process engine: decode step time at batch 1 and 16, and bytes per hop.

    python bench/distributed.py --device cpu --json bench/results/cpu_distributed.json
Runs SmolLM2-135M with the shipped head (K=3), in process and through Ray actors (TP=2 with a separate
draft worker, and TP=2 with the draft colocated in rank 0). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.build import build_engine
from cluster.engine import LLMEngine
from workers.config import MTPServeConfig

PROMPT = "Write a few sentences about why the ocean is salty."


def measure(engine: LLMEngine, batch: int, steps: int) -> dict[str, Any]:
    """Mean wall time of generation steps (after every prompt is prefilled)."""
    ids = engine.encode_prompt(PROMPT) if engine.tokenizer is not None else list(range(10, 40))
    rids = [engine.add_request(ids, {"max_tokens": 4 * steps + 8, "ignore_eos": True}) for _ in range(batch)]
    reqs = [engine.scheduler.requests[r] for r in rids]
    while any(r.in_context for r in reqs):
        engine.step()
    hops0 = dict(getattr(engine.target, "hops", {}))
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    for r in rids:
        engine.abort(r)
    hops = getattr(engine.target, "hops", None)
    per_step: dict[str, float] = {}
    if hops:
        n = hops["steps"] - hops0.get("steps", 0)
        for key in (
            "plan_bytes",
            "output_bytes",
            "draft_inputs_bytes",
            "draft_outputs_bytes",
            "rpc_s",
            "target_s",
            "draft_hop_s",
        ):
            per_step[key] = (hops.get(key, 0.0) - hops0.get(key, 0.0)) / max(n, 1)
    return {"batch": batch, "step_ms": 1e3 * dt, "hops_per_step": per_step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default="bench/results/cpu_distributed.json")
    ap.add_argument(
        "--dummy",
        action="store_true",
        help="random weights of SmolLM2's shape and a random head (no model files; timing only)",
    )
    ap.add_argument(
        "--setups",
        default="in-process,separate,colocated",
        help="comma list of in-process, separate (TP=2 + a draft worker: 3 devices), colocated (TP=2)",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base: dict[str, Any] = {"model": {"device": args.device}, "scheduler": {"max_num_requests": 16},
                            "speculative": {"num_draft_tokens": 3}}  # fmt: skip
    if args.dummy:
        from profile_step import SMOLLM2

        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(SMOLLM2))
        base["model"].update(path=str(tmp), load_format="dummy", max_model_len=2048)
        base["speculative"]["draft"] = "random"
    if args.enforce_eager:
        base["model"]["cuda_graphs"] = False
    setups = {
        "in-process": ("in-process", {}),
        "separate": ("ray tp=2, draft separate", {"parallel.tp_size": 2, "parallel.draft_placement": "separate"}),
        "colocated": ("ray tp=2, draft colocated", {"parallel.tp_size": 2, "parallel.draft_placement": "colocated"}),
    }
    chosen = [setups[k.strip()] for k in args.setups.split(",")]
    rows = []
    for name, over in chosen:
        engine = build_engine(MTPServeConfig.from_dict(base, over))
        try:
            for batch in (1, 16):
                r = measure(engine, batch, args.steps)
                r["setup"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
        finally:
            engine.shutdown()
    report = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "dummy_weights": args.dummy,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    keys = ("plan_bytes", "output_bytes", "draft_inputs_bytes", "draft_outputs_bytes")
    print("\nsetup | batch | step ms | " + " | ".join(keys))
    for r in rows:
        h = r["hops_per_step"]
        cells = [r["setup"], str(r["batch"]), f"{r['step_ms']:.1f}"] + [f"{h.get(k, 0):.0f}" for k in keys]
        print(" | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
