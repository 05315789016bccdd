"""Greedy tokens straight from hidden states: final RMSNorm, lm_head and argmax in two Triton launches
(CUDA; CPU via TRITON_INTERPRET), for the few rows of a decode, verify or draft step.

The usual path writes [rows, vocab] logits, converts them to fp32 and reduces them with torch's argmax,
which for one row of a 49k vocabulary runs as a single latency-bound block (13 us on an H200, against
16 us for reading the whole lm_head). Here each program of the first launch scores a slice of the
vocabulary with tensor-core products over chunks of the hidden size (the rows padded to 16) and keeps
only its best (logit, token) per row; the second launch reduces those partials. Logits are rounded to
the weight's dtype before comparing, as the separate projection rounds them, and ties go to the lowest
token id, as torch's argmax does.
"""

from __future__ import annotations

import logging

import torch

from mtpserve.modeling import pdl
from mtpserve.modeling.fused_kernels import GEMV_MAX_K, _need_triton

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    from mtpserve.modeling.pdl import wait_for_inputs
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

log = logging.getLogger(__name__)
_UNFIT: set[torch.dtype] = set()  # dtypes whose tile needs more shared memory than this GPU has


class TileDoesNotFit(RuntimeError):
    """The kernel's tile does not fit this GPU (shared memory); callers fall back to separate kernels."""


if triton is not None:

    @triton.jit
    def _lm_chunk(w_ptr, cols, k0, N, K, stride_w, BLOCK_K: tl.constexpr):
        # lm_head rows `cols`, hidden columns k0 .. k0 + BLOCK_K (zero outside the weight)
        ks = k0 + tl.arange(0, BLOCK_K)
        return tl.load(
            w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0
        )

    @triton.jit
    def _lm_update(acc, w, x_ptr, nw_ptr, rows, valid, inv, k0, K, stride_x, BLOCK_K: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M] plus the chunk's products with the normed rows, rounded as the norm rounds
        ks = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=valid & (ks[None, :] < K), other=0.0)
        nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        xn = (xk.to(tl.float32) * inv[:, None] * nw[None, :]).to(w.dtype)
        return acc + tl.dot(w, tl.trans(xn), input_precision="ieee")

    @triton.jit
    def _norm_argmax_tiles(
        x_ptr, nw_ptr, w_ptr, val_ptr, idx_ptr, M, N, K, eps, stride_x, stride_w, stride_p,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FULL_K: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # the best (rounded logit, lowest token) of this program's BLOCK_N vocabulary rows, per input row;
        # the first chunk of weights is read before waiting for the rows' writer
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows[:, None] < M
        first = _lm_chunk(w_ptr, cols, 0, N, K, stride_w, BLOCK_K)
        wait_for_inputs(PDL)
        full = tl.arange(0, FULL_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + full[None, :], mask=valid & (full[None, :] < K), other=0.0)
        x = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc = _lm_update(acc, first, x_ptr, nw_ptr, rows, valid, inv, 0, K, stride_x, BLOCK_K)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            w = _lm_chunk(w_ptr, cols, k0, N, K, stride_w, BLOCK_K)
            acc = _lm_update(acc, w, x_ptr, nw_ptr, rows, valid, inv, k0, K, stride_x, BLOCK_K)
        y = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
        y = tl.where(cols[:, None] < N, y, float("-inf"))
        best = tl.max(y, 0)
        token = tl.min(tl.where(y == best[None, :], cols[:, None], N), 0)
        tl.store(val_ptr + rows * stride_p + pid, best, mask=rows < M)
        tl.store(idx_ptr + rows * stride_p + pid, token, mask=rows < M)

    @triton.jit
    def _argmax_of_tiles(val_ptr, idx_ptr, out_ptr, T, N, stride_p, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0)
        t = tl.arange(0, BLOCK_T)
        v = tl.load(val_ptr + row * stride_p + t, mask=t < T, other=float("-inf"))
        i = tl.load(idx_ptr + row * stride_p + t, mask=t < T, other=N)
        best = tl.max(v, 0)
        token = tl.min(tl.where(v == best, i, N), 0)
        tl.store(out_ptr + row, tl.minimum(token, N - 1).to(tl.int64))  # a NaN row matches nothing: still an id


ARGMAX_MAX_ROWS = 16  # rows are padded to one 16-row tensor-core tile
ARGMAX_BLOCK_N = 256  # vocabulary rows per program of the first launch (bench/probes/kernel_check.py)
ARGMAX_BLOCK_K = 64  # hidden-size chunk per loop iteration
ARGMAX_STAGES = 3  # loads in flight per program


def norm_argmax_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `norm_argmax` takes rows x against the lm_head weight [V, d]: at most ARGMAX_MAX_ROWS rows,
    a weight with contiguous rows in x's dtype."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= ARGMAX_MAX_ROWS
        and x.shape[1] == weight.shape[1] <= GEMV_MAX_K
        and weight.stride(-1) == 1
        and weight.dtype == x.dtype
        and x.dtype not in _UNFIT
    )


def norm_argmax(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    block_n: int = ARGMAX_BLOCK_N,
    block_k: int = ARGMAX_BLOCK_K,
) -> torch.Tensor:
    """argmax(rms_norm(x) @ weight.T) per row, as int64 [M], for the rows `norm_argmax_fits` accepts."""
    _need_triton()
    if not norm_argmax_fits(x, weight):
        raise ValueError(
            f"norm_argmax takes 1-{ARGMAX_MAX_ROWS} rows of width <= {GEMV_MAX_K} against a weight with "
            f"contiguous rows in their dtype, got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = triton.cdiv(n, block_n)
    vals = torch.empty(m, tiles, dtype=torch.float32, device=x.device)
    idx = torch.empty(m, tiles, dtype=torch.int32, device=x.device)
    out = torch.empty(m, dtype=torch.long, device=x.device)
    on = pdl.active(x)
    try:
        _norm_argmax_tiles[(tiles,)](
            x, norm_weight, weight, vals, idx, m, n, k, eps, x.stride(0), weight.stride(0), vals.stride(0),
            BLOCK_M=ARGMAX_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, FULL_K=triton.next_power_of_2(k),
            STAGES=ARGMAX_STAGES, num_warps=4, PDL=on, **pdl.launch_args(on),
        )  # fmt: skip
    except OutOfResources as exc:
        _UNFIT.add(x.dtype)
        log.warning("greedy-token kernel does not fit this GPU in %s (%s); using separate kernels", x.dtype, exc)
        raise TileDoesNotFit(str(exc)) from exc
    _argmax_of_tiles[(m,)](
        vals, idx, out, tiles, n, vals.stride(0), BLOCK_T=triton.next_power_of_2(tiles), PDL=on, **pdl.launch_args(on)
    )
    return out
