"""The small-step projection kernels against what they replace, per call, on the GPU: norm + q/k/v,
norm + gate/up, SwiGLU + down and the attention output projection at SmolLM2-135M's shapes. For 1-16
rows: cuBLAS after a separate norm/SwiGLU kernel, the register kernels of `fused_kernels` (up to 4 rows,
two column-block sizes) and the tensor-core kernels of `mma_kernels` over a sweep of their tile sizes.
Each variant runs 50 times inside one CUDA graph, so the figures are GPU time per call including the
launch gaps a graph has.

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

from modeling import fused_kernels, mma_kernels
from modeling.layer_ops import TORCH_OPS, TritonOps

REPS = 50
ROWS = (1, 2, 4, 8, 16)
MMA_TILES = [(n, k, st) for n in (16, 32) for k in (64, 128, 256) for st in (2, 3)]  # BLOCK_N, BLOCK_K, STAGES
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


def mma_sweep(fn: Callable[[], torch.Tensor], ref: torch.Tensor) -> dict[str, float]:
    """GPU us per call and max abs error of the tensor-core kernel at every tile of MMA_TILES."""
    entry: dict[str, float] = {}
    default = mma_kernels.MMA_BLOCK_N, mma_kernels.MMA_BLOCK_K, mma_kernels.MMA_STAGES
    for tile in MMA_TILES:
        mma_kernels.MMA_BLOCK_N, mma_kernels.MMA_BLOCK_K, mma_kernels.MMA_STAGES = tile
        key = "mma_n{}_k{}_s{}".format(*tile)
        try:
            entry[f"{key}_us"] = graph_us(fn)
            entry[f"{key}_max_abs_err"] = (fn().float() - ref).abs().max().item()
        except Exception as exc:  # a tile the compiler cannot fit is reported, not fatal
            entry[f"{key}_error"] = repr(exc)[:300]  # type: ignore[assignment]
        finally:
            mma_kernels.MMA_BLOCK_N, mma_kernels.MMA_BLOCK_K, mma_kernels.MMA_STAGES = default
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    triton_ops = TritonOps()
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "reps_per_graph": REPS, "rows": {}}
    for rows in ROWS:
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

                def mma(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return mma_kernels.swiglu_linear(x, w)
            elif name == "o_proj":
                x = torch.randn(rows, k, device=dev, generator=g).to(dt)
                ref = torch.nn.functional.linear(x.float(), w.float())

                def separate(x: torch.Tensor = x, w: torch.Tensor = w) -> object:
                    return torch.nn.functional.linear(x, w)

                def fused(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return fused_kernels.linear(x, w)

                def mma(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return mma_kernels.linear(x, w)
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

                def mma(
                    x: torch.Tensor = x, r: torch.Tensor = r, nw: torch.Tensor = nw, w: torch.Tensor = w
                ) -> torch.Tensor:
                    return mma_kernels.norm_linear(x, r, nw, 1e-5, w)[0]

            entry: dict[str, float] = {"separate_us": graph_us(separate)}
            default_block = fused_kernels.GEMV_BLOCK_N
            for block_n in (8, 16) if rows <= fused_kernels.GEMV_MAX_ROWS else ():
                fused_kernels.GEMV_BLOCK_N = block_n
                try:
                    entry[f"fused_n{block_n}_us"] = graph_us(fused)
                    entry[f"fused_n{block_n}_max_abs_err"] = (fused().float() - ref).abs().max().item()
                except Exception as exc:  # a block the compiler cannot fit is reported, not fatal
                    entry[f"fused_n{block_n}_error"] = repr(exc)[:300]  # type: ignore[assignment]
                finally:
                    fused_kernels.GEMV_BLOCK_N = default_block
            entry.update(mma_sweep(mma, ref))
            per_rows[name] = entry
            print(rows, name, json.dumps(entry), flush=True)
        report["rows"][rows] = per_rows  # type: ignore[index]
    print("rows  shape          cuBLAS  register  best tensor-core (tile)")
    for rows, per_rows in report["rows"].items():  # type: ignore[attr-defined]
        for name, entry in per_rows.items():
            mma = {k[:-3]: v for k, v in entry.items() if k.startswith("mma_") and k.endswith("_us")}
            best = min(mma, key=mma.__getitem__) if mma else "-"
            reg = entry.get("fused_n8_us", float("nan"))
            tc = mma.get(best, float("nan"))
            print(f"{rows:>4}  {name:<13} {entry['separate_us']:7.2f}  {reg:8.2f}  {tc:6.2f} ({best})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
