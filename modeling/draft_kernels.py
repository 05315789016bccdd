"""The MTP head's input step in one Triton launch (CUDA; CPU via TRITON_INTERPRET): embedding lookup of
the draft tokens, RMSNorm of the embeddings and of the target's hidden states, their concatenation and
the eh_proj projection, for the few rows of a decode-time draft step.

Separately these are five launches (gather, two norms, concat, matrix product) of one to four microseconds
each, repeated for every draft token. Each program here loads its slice of eh_proj, gathers the embedding
rows by token id and reads the hidden rows at once, normalises both (rounded to the weight's dtype, as
the separate norms round them) and reduces the two halves of the product in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.modeling import fused_kernels, pdl
from mtpserve.modeling.fused_kernels import _need_triton

try:
    import triton
    import triton.language as tl

    from mtpserve.modeling.fused_kernels import _matvec, _store_rows, _tile_indices, _weight_tile
    from mtpserve.modeling.pdl import wait_for_inputs
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _normed(ptr, offsets, valid, nw_ptr, K, eps, ks, dtype: tl.constexpr):
        # rows at ptr + offsets [BLOCK_M], RMS-normed in fp32 and rounded to `dtype`
        inside = valid[:, None] & (ks[None, :] < K)
        x = tl.load(ptr + offsets[:, None] + ks[None, :], mask=inside, other=0.0).to(dtype).to(tl.float32)
        nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / K + eps)
        return (x * inv[:, None] * nw[None, :]).to(dtype).to(tl.float32)

    @triton.jit
    def _draft_input(
        ids_ptr, emb_ptr, enw_ptr, hid_ptr, hnw_ptr, w_ptr, y_ptr, M, N, K, eps,
        stride_e, stride_h, stride_w, stride_y,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        ROW_LOOP: tl.constexpr,
    ):  # fmt: skip
        _, rows, ks, cols = _tile_indices(BLOCK_M, BLOCK_N, BLOCK_K)
        w_e = _weight_tile(w_ptr, cols, ks, stride_w, N, K)
        w_h = _weight_tile(w_ptr + K, cols, ks, stride_w, N, K)
        wait_for_inputs(PDL)
        valid = rows < M
        ids = tl.load(ids_ptr + rows, mask=valid, other=0).to(tl.int64)
        dtype = w_ptr.dtype.element_ty
        e = _normed(emb_ptr, ids * stride_e, valid, enw_ptr, K, eps, ks, dtype)
        h = _normed(hid_ptr, rows.to(tl.int64) * stride_h, valid, hnw_ptr, K, eps, ks, dtype)
        _store_rows(y_ptr, _matvec(e, w_e, ROW_LOOP) + _matvec(h, w_h, ROW_LOOP), rows, cols, stride_y, M, N)


@dataclass(frozen=True)
class DraftInputWeights:
    """The MTP head's input step: the target's embedding table [V, d], the embedding and hidden-state norm
    weights [d] with their eps, and eh_proj [d_out, 2d]."""

    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eps: float
    eh_proj: torch.Tensor


def draft_input_fits(tokens: torch.Tensor, hidden: torch.Tensor, w: DraftInputWeights) -> bool:
    """Whether `draft_input` takes these rows: one token per hidden row, at most `fused_kernels.GEMV_MAX_ROWS` of at
    most `GEMV_MAX_K` columns, with unit column strides and one dtype for the embedding table, eh_proj and the
    output."""
    d = w.embed.shape[1]
    return (
        tokens.dim() == 1
        and hidden.dim() == 2
        and tokens.shape[0] == hidden.shape[0]
        and 0 < tokens.shape[0] <= fused_kernels.GEMV_MAX_ROWS
        and d <= fused_kernels.GEMV_MAX_K
        and w.eh_proj.shape[1] == 2 * d
        and hidden.shape[1] == d
        and w.embed.stride(-1) == w.eh_proj.stride(-1) == 1
        and w.embed.dtype == w.eh_proj.dtype
    )


def draft_input(tokens: torch.Tensor, hidden: torch.Tensor, w: DraftInputWeights) -> torch.Tensor:
    """cat(enorm(embed(tokens)), hnorm(hidden)) @ eh_proj.T: tokens [M], hidden [M, d] -> [M, d_out] in the
    weights' dtype; for the few rows `draft_input_fits` accepts."""
    _need_triton()
    if not draft_input_fits(tokens, hidden, w):
        raise ValueError(
            f"draft_input takes 1-{fused_kernels.GEMV_MAX_ROWS} rows of width <= {fused_kernels.GEMV_MAX_K} with "
            f"eh_proj [d_out, 2d] and one dtype; got tokens {tuple(tokens.shape)}, hidden {tuple(hidden.shape)}, "
            f"eh_proj {tuple(w.eh_proj.shape)}"
        )
    m, d = hidden.shape
    n = w.eh_proj.shape[0]
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    tokens = tokens.contiguous()
    y = torch.empty(m, n, dtype=w.eh_proj.dtype, device=hidden.device)
    block_k = triton.next_power_of_2(d)
    tiles = fused_kernels.gemv_tiles(m)
    on = pdl.active(hidden)
    block_m = tiles.rows_per_program(m)
    _draft_input[(triton.cdiv(n, tiles.block_n), triton.cdiv(m, block_m))](
        tokens, w.embed, w.enorm, hidden, w.hnorm, w.eh_proj, y, m, n, d, w.eps,
        w.embed.stride(0), hidden.stride(0), w.eh_proj.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps(block_k), ROW_LOOP=tiles.row_loop, PDL=on, **pdl.launch_args(on),
    )  # fmt: skip
    return y
