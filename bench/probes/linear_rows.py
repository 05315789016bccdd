"""Projection cost by row count at a model's weight shapes: cuBLAS (`F.linear`) per call inside a CUDA graph,
with the effective weight bandwidth. It shows where a verify step of M rows stops costing what one row costs.
(A skinny-GEMM Triton kernel that read each weight tile once for all rows did not beat cuBLAS at Llama-3-8B's
shapes, 0.83-1.09x from 5 to 64 rows: `profile_8b.json`, git 8b35158.)

python3 bench/probes/linear_rows.py --shape DIR --out $OUT     # DIR holds a config.json (e.g. Llama-3-8B's)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """[N, K] of a Llama layer's fused projections and the lm_head."""
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or d // heads
    return {
        "qkv": ((heads + 2 * kv) * hd, d),
        "o": (d, heads * hd),
        "gate_up": (2 * inter, d),
        "down": (d, inter),
        "lm_head": (cfg["vocab_size"], d),
    }


def graph_us(fn: Any, calls: int = 20, replays: int = 10) -> float:
    """Mean microseconds per call of `fn` over `calls` calls captured in one CUDA graph, replayed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="a directory with a config.json")
    ap.add_argument("--rows", default="1,4,5,8,9,16,17,24,25,32,48,64")
    ap.add_argument("--out", default="out")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    cfg = json.loads((Path(args.shape) / "config.json").read_text())
    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, Any] = {"shape": cfg, "rows": rows, "device": torch.cuda.get_device_name(), "results": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in weight_shapes(cfg).items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        gbytes = w.numel() * w.element_size() / 1e9
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            row: dict[str, Any] = {"weight": name, "n": n, "k": k, "m": m}
            us = graph_us(lambda x=x, w=w: F.linear(x, w))
            row["cublas_us"], row["cublas_tb_s"] = us, gbytes / us * 1e3
            out["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"linear_rows_{Path(args.shape).name}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
