"""Mixed greedy / temperature-only / top-k-top-p batches on captured steps, on the GPU: the same tokens
with and without overlapped steps (all captured variants share one memory pool), per K.

The requests finish in an order that walks the step through every captured variant: top-k and top-p
requests first (top-k/top-p variant), then temperature-only ones (temperature variant), then greedy ones.
Both runs see the same batch at every step. (When requests arrive mid-run, overlapped and sequential runs
batch them at different steps, and different batch sizes take different kernels, so near-uniform sampled
distributions of random weights can flip tokens; that comparison is not an equality.)

python bench/sampling_check.py --out $OUT      # SmolLM2-135M shape, random weights and head
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.profile_step import SMOLLM2
from cluster.engine import LLMEngine
from speculative.sampling import SamplingMode
from workers.config import MTPServeConfig

PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 52, "ignore_eos": True},
    {"max_tokens": 36, "temperature": 0.8, "seed": 1, "ignore_eos": True},
    {"max_tokens": 28, "temperature": 1.0, "top_p": 0.9, "seed": 2, "ignore_eos": True},
    {"max_tokens": 20, "temperature": 0.7, "top_k": 20, "seed": 3, "ignore_eos": True},
    {"max_tokens": 44, "temperature": 1.2, "seed": 4, "ignore_eos": True},
    {"max_tokens": 60, "ignore_eos": True},
]


def tokens(model_dir: Path, k: int, overlap: bool, device: str, dtype: str) -> tuple[list[list[int]], list[str]]:
    """Every request's tokens, and the sampling mode of each captured step that ran."""
    cfg = MTPServeConfig.from_dict({
        "model": {"path": str(model_dir), "load_format": "dummy", "device": device, "dtype": dtype,
                  "max_model_len": 512, "overlap_steps": overlap, "overlap_speculative": overlap},
        "scheduler": {"max_num_requests": 8},
        "speculative": {"enabled": k > 0, "draft": "random", "num_draft_tokens": max(k, 1)},
    })  # fmt: skip
    eng = LLMEngine.from_config(cfg)
    modes: list[str] = []
    runner = eng.target
    for step in (getattr(runner, "fused", None), getattr(runner, "uniform", None)):
        if step is not None:
            run = step.steps.run

            def spy(size: int, mode: SamplingMode, run: Any = run) -> Any:
                modes.append(mode.value)
                return run(size, mode)

            step.steps.run = spy
    ids = [eng.add_request(list(range(200 + 7 * i, 230 + 7 * i)), p) for i, p in enumerate(PARAMS)]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[r] for r in ids], [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run")
    ap.add_argument("--ks", default="0,1,3", help="draft tokens per step to check (0: target only)")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32 by default: with and without overlap, late arrivals change which steps run at which batch "
        "size, and in bf16 the kernels of different batch sizes round differently enough to flip near-ties",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(SMOLLM2))
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    report: dict[str, Any] = {"gpu": gpu, "dtype": args.dtype, "runs": {}}
    for k in (int(x) for x in args.ks.split(",")):
        a, modes = tokens(tmp, k, True, args.device, args.dtype)
        b, _ = tokens(tmp, k, False, args.device, args.dtype)
        entry = {
            "same_tokens": a == b,
            "lengths": [len(t) for t in a],
            "expected_lengths": [p["max_tokens"] for p in PARAMS],
            "variants_in_order": modes,
        }
        report["runs"][f"k{k}"] = entry
        print(f"k={k}", json.dumps(entry), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sampling_check.json").write_text(json.dumps(report, indent=2))
    ok = all(e["same_tokens"] and e["lengths"] == e["expected_lengths"] for e in report["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
