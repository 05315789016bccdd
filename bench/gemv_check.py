"""The matrix-vector kernels against what they replace, per call, on the GPU: norm + q/k/v, norm + gate/up,
SwiGLU + down and the attention output projection at SmolLM2-135M's shapes, for 1-4 rows and two
column-block sizes. Each variant runs 50
times inside one CUDA graph, so the figures are GPU time per call including the launch gaps a graph has.

python bench/gemv_check.py --out $OUT      # one GPU; writes gemv_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modeling import fused_kernels
from modeling.layer_ops import TORCH_OPS, TritonOps

REPS = 50
SHAPES = {"norm+qkv": (960, 576), "norm+gate_up": (3072, 576), "swiglu+down": (576, 1536), "o_proj": (576, 576)}


def graph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds per call of fn, replayed REPS times inside one captured graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * REPS))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    triton_ops = TritonOps()
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "reps_per_graph": REPS, "rows": {}}
    for rows in (1, 2, 4):
        per_rows: dict[str, object] = {}
        for name, (n, k) in SHAPES.items():
            w = (0.05 * torch.randn(n, k, device=dev, generator=g)).to(dt)
            if name == "swiglu+down":
                x = torch.randn(rows, 2 * k, device=dev, generator=g).to(dt)
                ref = TORCH_OPS.swiglu_linear(x.float(), w.float())

                def separate(x: torch.Tensor = x, w: torch.Tensor = w) -> object:
                    return torch.nn.functional.linear(triton_ops.silu_mul(x), w)

                def fused(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return fused_kernels.swiglu_linear(x, w)
            elif name == "o_proj":
                x = torch.randn(rows, k, device=dev, generator=g).to(dt)
                ref = torch.nn.functional.linear(x.float(), w.float())

                def separate(x: torch.Tensor = x, w: torch.Tensor = w) -> object:
                    return torch.nn.functional.linear(x, w)

                def fused(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return fused_kernels.linear(x, w)
            else:
                x = torch.randn(rows, k, device=dev, generator=g).to(dt)
                r = torch.randn(rows, k, device=dev, generator=g).to(dt)
                nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
                ref = TORCH_OPS.norm_linear(x.float(), r.float(), nw.float(), 1e-5, w.float())[0]

                def separate(
                    x: torch.Tensor = x, r: torch.Tensor = r, nw: torch.Tensor = nw, w: torch.Tensor = w
                ) -> object:
                    h, _ = triton_ops.add_rms_norm(x, r, nw, 1e-5)
                    return torch.nn.functional.linear(h, w)

                def fused(
                    x: torch.Tensor = x, r: torch.Tensor = r, nw: torch.Tensor = nw, w: torch.Tensor = w
                ) -> torch.Tensor:
                    return fused_kernels.norm_linear(x, r, nw, 1e-5, w)[0]

            entry: dict[str, float] = {"separate_us": graph_us(separate)}
            default_block = fused_kernels.GEMV_BLOCK_N
            for block_n in (8, 16):
                fused_kernels.GEMV_BLOCK_N = block_n
                try:
                    entry[f"fused_n{block_n}_us"] = graph_us(fused)
                    entry[f"fused_n{block_n}_max_abs_err"] = (fused().float() - ref).abs().max().item()
                except Exception as exc:  # a block the compiler cannot fit is reported, not fatal
                    entry[f"fused_n{block_n}_error"] = repr(exc)[:300]  # type: ignore[assignment]
                finally:
                    fused_kernels.GEMV_BLOCK_N = default_block
            per_rows[name] = entry
            print(rows, name, json.dumps(entry), flush=True)
        report["rows"][rows] = per_rows  # type: ignore[index]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
