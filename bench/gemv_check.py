"""The matrix-vector kernels against what they replace, per call, on the GPU: norm + q/k/v, norm + gate/up,
SwiGLU + down and the attention output projection at SmolLM2-135M's shapes, for 1-8 rows and two
column-block sizes. Each
variant runs 50 times inside one CUDA graph, so the figures are GPU time per call including the launch
gaps a graph has. The calls cycle through 32 copies of the weight (more than the L2 cache holds), so
each reads its weight from memory, as a model's layers do.

python bench/gemv_check.py --out $OUT      # one GPU; writes gemv_check.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modeling import fused_kernels
from modeling.layer_ops import TORCH_OPS, TritonOps

REPS = 50
COPIES = 32  # weight copies the timed calls cycle through
ROWS = (1, 2, 4, 8)
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


def variants(name: str) -> tuple[Callable[..., object], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """(what the kernel replaces, the kernel, the fp32 reference) for one shape, each f(x, r, nw, w)."""
    triton_ops = TritonOps()
    if name == "swiglu+down":
        return (
            lambda x, r, nw, w: torch.nn.functional.linear(triton_ops.silu_mul(x), w),
            lambda x, r, nw, w: fused_kernels.swiglu_linear(x, w),
            lambda x, r, nw, w: TORCH_OPS.swiglu_linear(x.float(), w.float()),
        )
    if name == "o_proj":
        return (
            lambda x, r, nw, w: torch.nn.functional.linear(x, w),
            lambda x, r, nw, w: fused_kernels.linear(x, w),
            lambda x, r, nw, w: torch.nn.functional.linear(x.float(), w.float()),
        )
    return (
        lambda x, r, nw, w: torch.nn.functional.linear(triton_ops.add_rms_norm(x, r, nw, 1e-5)[0], w),
        lambda x, r, nw, w: fused_kernels.norm_linear(x, r, nw, 1e-5, w)[0],
        lambda x, r, nw, w: TORCH_OPS.norm_linear(x.float(), r.float(), nw.float(), 1e-5, w.float())[0],
    )


def cycled_us(fn: Callable[..., object], x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, copies: list) -> float:
    """graph_us of fn(x, r, nw, w) with successive calls reading successive weight copies."""
    pick = itertools.cycle(copies)
    return graph_us(lambda: fn(x, r, nw, next(pick)))


KNOBS = ("GEMV_BLOCK_N", "GEMV_MAX_ROWS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "reps_per_graph": REPS,
                                 "weight_copies": COPIES, "rows": {}}  # fmt: skip
    defaults = {k: getattr(fused_kernels, k) for k in KNOBS}
    for rows in ROWS:
        per_rows: dict[str, object] = {}
        for name, (n, k) in SHAPES.items():
            copies = [(0.05 * torch.randn(n, k, device=dev, generator=g)).to(dt) for _ in range(COPIES)]
            width = 2 * k if name == "swiglu+down" else k
            x = torch.randn(rows, width, device=dev, generator=g).to(dt)
            r = torch.randn(rows, k, device=dev, generator=g).to(dt)
            nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
            separate, kernel, reference = variants(name)
            ref = reference(x, r, nw, copies[0])
            entry: dict[str, float | str] = {"separate_us": cycled_us(separate, x, r, nw, copies)}
            for block_n in (8, 16):
                label = f"n{block_n}"
                fused_kernels.GEMV_BLOCK_N, fused_kernels.GEMV_MAX_ROWS = block_n, max(ROWS)
                try:
                    entry[f"{label}_us"] = cycled_us(kernel, x, r, nw, copies)
                    entry[f"{label}_max_abs_err"] = (kernel(x, r, nw, copies[0]).float() - ref).abs().max().item()
                except Exception as exc:  # a block the compiler cannot fit is reported, not fatal
                    entry[f"{label}_error"] = repr(exc)[:300]
                finally:
                    for knob, value in defaults.items():
                        setattr(fused_kernels, knob, value)
            per_rows[name] = entry
            del copies
        report["rows"][rows] = per_rows  # type: ignore[index]
    print("rows  shape          cuBLAS  kernel (n8)  best (setting)")
    for rows, per_rows in report["rows"].items():  # type: ignore[attr-defined]
        for name, entry in per_rows.items():
            timed = {k[:-3]: v for k, v in entry.items() if k.endswith("_us") and k != "separate_us"}
            best = min(timed, key=timed.__getitem__)
            print(f"{rows:>4}  {name:<13} {entry['separate_us']:7.2f}  {timed.get('n8', float('nan')):11.2f}  "
                  f"{timed[best]:6.2f} ({best})")  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
