"""Greedy tokens straight from hidden states: final RMSNorm, lm_head and argmax in two Triton launches
(CUDA; CPU via TRITON_INTERPRET), for the few rows of a decode, verify or draft step.

The usual path writes [rows, vocab] logits, converts them to fp32 and reduces them with torch's argmax,
which for one row of a 49k vocabulary runs as a single latency-bound block (13 us on an H200, against
16 us for reading the whole lm_head). Here each program of the first launch scores a slice of the
vocabulary and keeps only its best (logit, token) per row; the second reduces those partials. Logits are
rounded to the weight's dtype before comparing, as the separate projection rounds them, and ties go to
the lowest token id, as torch's argmax does.
"""

from __future__ import annotations

import torch

from workers.fused_kernels import GEMV_MAX_ROWS, _need_triton, gemv_takes

try:
    import triton
    import triton.language as tl

    from workers.fused_kernels import _rows_in
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _norm_argmax_tiles(
        x_ptr, nw_ptr, w_ptr, val_ptr, idx_ptr, M, N, K, eps, stride_x, stride_w, stride_p,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # the best (rounded logit, lowest token) of this program's BLOCK_N vocabulary rows, per input row
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(
            w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0
        )
        x = _rows_in(x_ptr, x_ptr, nw_ptr, x_ptr, w_ptr, pid, M, K, eps, stride_x, stride_x, stride_x,
                     True, False, BLOCK_M, BLOCK_K)  # fmt: skip
        y = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        y = y.to(w_ptr.dtype.element_ty).to(tl.float32)
        y = tl.where(cols[None, :] < N, y, float("-inf"))
        best = tl.max(y, 1)
        token = tl.min(tl.where(y == best[:, None], cols[None, :], N), 1)
        tl.store(val_ptr + rows * stride_p + pid, best, mask=rows < M)
        tl.store(idx_ptr + rows * stride_p + pid, token, mask=rows < M)

    @triton.jit
    def _argmax_of_tiles(val_ptr, idx_ptr, out_ptr, T, N, stride_p, BLOCK_T: tl.constexpr):
        row = tl.program_id(0)
        t = tl.arange(0, BLOCK_T)
        v = tl.load(val_ptr + row * stride_p + t, mask=t < T, other=float("-inf"))
        i = tl.load(idx_ptr + row * stride_p + t, mask=t < T, other=N)
        best = tl.max(v, 0)
        tl.store(out_ptr + row, tl.min(tl.where(v == best, i, N), 0).to(tl.int64))


ARGMAX_BLOCK_N = 8  # vocabulary rows per program of the first launch


def norm_argmax_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `norm_argmax` takes rows x against the lm_head weight [V, d]."""
    return x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and gemv_takes(x, weight)


def norm_argmax(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, block_n: int = ARGMAX_BLOCK_N
) -> torch.Tensor:
    """argmax(rms_norm(x) @ weight.T) per row, as int64 [M], for the few rows `norm_argmax_fits` accepts."""
    _need_triton()
    if not norm_argmax_fits(x, weight):
        raise ValueError(
            f"norm_argmax takes 1-{GEMV_MAX_ROWS} rows against a weight with contiguous rows in their dtype, "
            f"got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, dtype=torch.long, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = triton.cdiv(n, block_n)
    vals = torch.empty(m, tiles, dtype=torch.float32, device=x.device)
    idx = torch.empty(m, tiles, dtype=torch.int32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _norm_argmax_tiles[(tiles,)](
        x, norm_weight, weight, vals, idx, m, n, k, eps, x.stride(0), weight.stride(0), vals.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_k <= 1024 else 8,
    )  # fmt: skip
    _argmax_of_tiles[(m,)](vals, idx, out, tiles, n, vals.stride(0), BLOCK_T=triton.next_power_of_2(tiles))
    return out
