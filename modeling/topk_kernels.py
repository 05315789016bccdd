"""The k most likely tokens of a few rows of logits and their log-probabilities, in two Triton launches
(CUDA; CPU via TRITON_INTERPRET).

A draft tree scores each level's candidates as top-k(logits) - logsumexp(logits). With torch that is a
cast to fp32, a multi-block radix top-k (about twenty kernels and two memsets per call over a large
vocabulary) and two reductions for the normaliser, once per tree level. Here the first launch reads each
(row, vocabulary tile) once and keeps the tile's k best (logit, token) pairs and its (max, sum of
exponentials); the second merges the tiles of each row. Ties go to the lowest token id, so the order is
(log-probability descending, token ascending).
"""

from __future__ import annotations

import torch

from mtpserve.modeling.fused_kernels import _need_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

TOPK_BLOCK_N = 2048  # vocabulary entries per program of the first launch
TOPK_MAX_K = 16  # the largest k the unrolled selection loops take


if triton is not None:

    @triton.jit
    def _topk_tiles(
        x_ptr, val_ptr, idx_ptr, max_ptr, sum_ptr, N, T, stride_x, K: tl.constexpr, BLOCK_N: tl.constexpr
    ):  # fmt: skip
        # one row's tile: its K best (logit, lowest token) and its max and sum of exp(logit - max)
        tile, row = tl.program_id(0), tl.program_id(1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        y = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        top = tl.max(y, 0)
        tl.store(max_ptr + row * T + tile, top)
        tl.store(sum_ptr + row * T + tile, tl.sum(tl.exp(y - top), 0))
        out = (row * T + tile) * K
        for j in tl.static_range(K):
            best = tl.max(y, 0)
            token = tl.min(tl.where(y == best, cols, N), 0)
            tl.store(val_ptr + out + j, best)
            tl.store(idx_ptr + out + j, token)
            y = tl.where(cols == token, float("-inf"), y)

    @triton.jit
    def _topk_merge(
        val_ptr, idx_ptr, max_ptr, sum_ptr, out_val_ptr, out_idx_ptr, N, T,
        K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        # a row's K best of its tiles' candidates, minus the row's logsumexp
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        v = tl.load(val_ptr + row * T * K + c, mask=c < T * K, other=float("-inf"))
        i = tl.load(idx_ptr + row * T * K + c, mask=c < T * K, other=N)
        t = tl.arange(0, BLOCK_T)
        m = tl.load(max_ptr + row * T + t, mask=t < T, other=float("-inf"))
        s = tl.load(sum_ptr + row * T + t, mask=t < T, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        for j in tl.static_range(K):
            best = tl.max(v, 0)
            token = tl.min(tl.where(v == best, i, N), 0)
            tl.store(out_val_ptr + row * K + j, best - lse)
            tl.store(out_idx_ptr + row * K + j, tl.minimum(token, N - 1).to(tl.int64))  # NaN rows: still ids
            v = tl.where(i == token, float("-inf"), v)


def top_logprobs_fits(logits: torch.Tensor, k: int) -> bool:
    """Whether `top_logprobs` takes these logits: 2-D, at least one row, 1 <= k <= min(TOPK_MAX_K, vocab)."""
    return logits.dim() == 2 and logits.shape[0] > 0 and 1 <= k <= min(TOPK_MAX_K, logits.shape[1])


def top_logprobs(logits: torch.Tensor, k: int, block_n: int = TOPK_BLOCK_N) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-softmax values of each row of logits [M, V] (fp32 [M, k]) and their token ids
    (int64 [M, k]), best first, ties to the lowest id."""
    _need_triton()
    if not top_logprobs_fits(logits, k):
        raise ValueError(
            f"top_logprobs takes 2-D logits with rows and 1 <= k <= {TOPK_MAX_K} (and the vocabulary), "
            f"got {tuple(logits.shape)} and k={k}"
        )
    m, n = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    tiles = triton.cdiv(n, block_n)
    dev = x.device
    vals = torch.empty(m, tiles * k, dtype=torch.float32, device=dev)
    idx = torch.empty(m, tiles * k, dtype=torch.int32, device=dev)
    tile_max = torch.empty(m, tiles, dtype=torch.float32, device=dev)
    tile_sum = torch.empty(m, tiles, dtype=torch.float32, device=dev)
    _topk_tiles[(tiles, m)](x, vals, idx, tile_max, tile_sum, n, tiles, x.stride(0), K=k, BLOCK_N=block_n)
    out_val = torch.empty(m, k, dtype=torch.float32, device=dev)
    out_idx = torch.empty(m, k, dtype=torch.long, device=dev)
    _topk_merge[(m,)](
        vals, idx, tile_max, tile_sum, out_val, out_idx, n, tiles,
        K=k, BLOCK_C=triton.next_power_of_2(tiles * k), BLOCK_T=triton.next_power_of_2(tiles),
    )  # fmt: skip
    return out_val, out_idx
