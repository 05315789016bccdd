"""x @ W.T for a few rows (5-64) against a wide weight: one Triton kernel that reads each weight tile once
for all rows, for the verify steps of chains and trees at large shapes, where cuBLAS's tile choice for a
skinny M leaves memory bandwidth unused.

Each program owns BLOCK_N output columns and walks the whole K dimension, so the weight is read exactly once;
the rows ride along in a [BLOCK_M, BLOCK_K] tile that stays in L2. `CONFIGS` maps a weight's shape class to
its tile sizes (timed on an H200 by `bench/probes/linear_rows.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU image may lack Triton
    triton = None  # type: ignore[assignment]

MIN_ROWS, MAX_ROWS = 5, 64  # row counts the kernel takes; 1-4 go to the matrix-vector kernels


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of one kernel variant."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = TileConfig(16, 256)


def available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


def fits(rows: int, weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernel takes `rows` rows x against weight [N, K]: a skinny step, a weight with contiguous
    rows in x's dtype (bf16 or fp16: the kernel multiplies on tensor cores), K a multiple of 16."""
    return (
        triton is not None
        and MIN_ROWS <= rows <= MAX_ROWS
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and weight.dtype == x.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[1] % 16 == 0
    )


def block_m(rows: int) -> int:
    """Rows per tile: the next power of two, at least 16 (the tensor-core minimum)."""
    return max(16, 1 << (rows - 1).bit_length())


if triton is not None:

    @triton.jit
    def _skinny(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks)[None, :] < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok & k_ok, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=col_ok & k_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w))
        out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """x @ weight.T for rows x [M, K] and weight [N, K], M in [MIN_ROWS, MAX_ROWS] (see `fits`)."""
    if triton is None:
        raise RuntimeError("skinny_gemm needs Triton")
    m, k = x.shape
    n = weight.shape[0]
    if not fits(m, weight, x) or weight.shape[1] != k:
        raise ValueError(
            f"skinny_gemm takes {MIN_ROWS}-{MAX_ROWS} bf16/fp16 rows against a [N, K] weight with K % 16 == 0 in "
            f"their dtype, got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    cfg = config or config_for(n, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n),)
    _skinny[grid](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


CONFIGS: dict[tuple[int, int], TileConfig] = {}  # (N, K) -> tiles; others take DEFAULT_CONFIG


def config_for(n: int, k: int) -> TileConfig:
    """The tile sizes for a weight of shape [n, k]."""
    return CONFIGS.get((n, k), DEFAULT_CONFIG)
