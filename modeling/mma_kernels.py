"""Tensor-core projections for steps of a few rows (CUDA; CPU via TRITON_INTERPRET).

- `norm_linear`: residual add, RMSNorm and the projection after it, as `fused_kernels.norm_linear`.
- `linear`: a plain projection.
- `swiglu_linear`: silu(gate) * up and the down projection, as `fused_kernels.swiglu_linear`.

The register kernels of `fused_kernels` reduce [rows, columns, K] products in registers, which is
fastest for one row but spills as rows grow (a verify step of 4 rows costs up to 1.7x a decode row).
These compute weight-tile x rows^T with tensor-core products instead, the rows padded to one 16-row
tile, over chunks of K with a few loads in flight, so their cost barely moves from 2 to 16 rows. The
rounding points are the reference's (`layer_ops.TorchOps`): the residual sum and the normed or SwiGLU
rows are rounded to the weight's dtype before the product, which accumulates in fp32.
"""

from __future__ import annotations

import torch

from modeling.fused_kernels import GEMV_MAX_K, _need_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _mma_norm_linear(
        x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, M, N, K, eps,
        stride_x, stride_r, stride_w, stride_y, stride_res,
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, FULL_K: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows[:, None] < M
        inv = tl.full((BLOCK_M,), 1.0, tl.float32)
        if HAS_NORM:
            full = tl.arange(0, FULL_K)
            fm = valid & (full[None, :] < K)
            s = tl.load(x_ptr + rows[:, None] * stride_x + full[None, :], mask=fm, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_ptr + rows[:, None] * stride_r + full[None, :], mask=fm, other=0.0).to(tl.float32)
                s = (s + r).to(res_ptr.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(s * s, 1) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks[None, :] < K
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols[:, None] < N) & inside, other=0.0)
            xk = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=valid & inside, other=0.0)
            if HAS_RES:
                rk = tl.load(r_ptr + rows[:, None] * stride_r + ks[None, :], mask=valid & inside, other=0.0)
                sk = (xk.to(tl.float32) + rk.to(tl.float32)).to(res_ptr.dtype.element_ty)
                first = tl.where(pid == 0, M, 0)  # program 0 stores the new residual
                tl.store(res_ptr + rows[:, None] * stride_res + ks[None, :], sk, mask=(rows[:, None] < first) & inside)
                xk = sk
            if HAS_NORM:
                nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                xk = xk.to(tl.float32) * inv[:, None] * nw[None, :]
            acc += tl.dot(w, tl.trans(xk.to(w.dtype)), input_precision="ieee")
        out = tl.trans(acc)
        mask = valid & (cols[None, :] < N)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mma_swiglu_linear(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows[:, None] < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks[None, :] < K
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols[:, None] < N) & inside, other=0.0)
            at = x_ptr + rows[:, None] * stride_x + ks[None, :]
            g = tl.load(at, mask=valid & inside, other=0.0).to(tl.float32)
            u = tl.load(at + K, mask=valid & inside, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(w_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.dot(w, tl.trans((act * u).to(w.dtype)), input_precision="ieee")
        out = tl.trans(acc)
        mask = valid & (cols[None, :] < N)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


MMA_MAX_ROWS = 16  # rows are padded to one 16-row tensor-core tile
MMA_BLOCK_N = 16  # output columns per program (bench/gemv_check.py)
MMA_BLOCK_K = 128  # K chunk per loop iteration
MMA_STAGES = 2  # chunks in flight per program


def mma_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels take rows x against weight [N, K] (x [M, K], or [M, 2K] for SwiGLU): 1 to
    MMA_MAX_ROWS rows, K <= GEMV_MAX_K, a weight with contiguous rows, and one dtype for both."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MMA_MAX_ROWS
        and weight.shape[1] <= GEMV_MAX_K
        and weight.stride(-1) == 1
        and weight.dtype == x.dtype
    )


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if not mma_takes(x, weight) or weight.shape[1] != k:
        raise ValueError(
            f"tensor-core projections take 1-{MMA_MAX_ROWS} rows of width <= {GEMV_MAX_K} against a weight "
            f"with contiguous rows in their dtype, got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )


def _meta() -> dict[str, int]:
    return {"BLOCK_M": MMA_MAX_ROWS, "BLOCK_N": MMA_BLOCK_N, "BLOCK_K": MMA_BLOCK_K, "STAGES": MMA_STAGES}


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T, x + residual) for rows x [M, K] and weight [N, K]; without a
    residual the second is x; without a norm weight the rows are projected as they are."""
    _need_triton()
    _check(x, weight, x.shape[1])
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is None:
        r = res = x
    else:
        r = residual if residual.stride(-1) == 1 else residual.contiguous()
        res = torch.empty_like(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _mma_norm_linear[(triton.cdiv(n, MMA_BLOCK_N),)](
        x, r, weight if norm_weight is None else norm_weight, weight, y, res, m, n, k, eps,
        x.stride(0), r.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, FULL_K=triton.next_power_of_2(k),
        num_warps=4, **_meta(),
    )  # fmt: skip
    return y, res


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for rows x [M, K] and weight [N, K]."""
    return norm_linear(x, None, None, 0.0, weight)[0]


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up [M, 2K] laid out as [gate | up] and weight [N, K]."""
    _need_triton()
    m, two_k = gate_up.shape
    k = two_k // 2
    _check(gate_up, weight, k)
    n = weight.shape[0]
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    y = torch.empty(m, n, dtype=gate_up.dtype, device=gate_up.device)
    _mma_swiglu_linear[(triton.cdiv(n, MMA_BLOCK_N),)](
        gate_up, weight, y, m, n, k, gate_up.stride(0), weight.stride(0), y.stride(0), num_warps=4, **_meta()
    )
    return y
