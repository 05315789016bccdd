"""The draft tree's top-k log-probability kernel (`modeling/topk_kernels.py`), run on CPU through Triton's
interpreter, against torch's top-k and logsumexp."""

from __future__ import annotations

import pytest
import torch

from mtpserve.modeling import argmax_kernels, fused_kernels, topk_kernels
from mtpserve.modeling.layer_ops import TORCH_OPS, TritonOps

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")


@pytest.mark.parametrize(
    ("rows", "vocab", "k", "block_n"),
    [(1, 1000, 4, 256), (5, 5000, 4, 2048), (3, 300, 8, 128), (2, 17, 16, 16), (16, 2500, 3, 512)],
)
def test_top_logprobs_match_torch(rows: int, vocab: int, k: int, block_n: int) -> None:
    """Values to 1e-5 and the same indices in the same order, over one tile or many (a partial last tile)."""
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    got, index = topk_kernels.top_logprobs(logits, k, block_n)
    want, want_index = TORCH_OPS.top_logprobs(logits, k)
    assert got.dtype == torch.float32 and index.dtype == torch.long and got.shape == (rows, k)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(index, want_index)
    assert bool((got[:, :-1] >= got[:, 1:]).all()), "best first"


def test_ties_go_to_the_lowest_token_across_tiles() -> None:
    """Equal logits in different tiles come out lowest token first, and the normaliser counts every entry."""
    logits = torch.zeros(2, 100)
    logits[:, [97, 5, 40, 63]] = 2.0
    _, index = topk_kernels.top_logprobs(logits, 5, block_n=32)
    assert index.tolist() == [[5, 40, 63, 97, 0]] * 2
    vals, _ = topk_kernels.top_logprobs(logits, 1, block_n=32)
    torch.testing.assert_close(vals[:, 0], torch.log_softmax(logits, -1)[:, 5])


def test_half_precision_logits_are_read_as_they_are() -> None:
    """bf16 logits: the values of torch's fp32 computation over the same numbers (ties aside, the same set)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 4000, generator=g) * 3).to(torch.bfloat16)
    got, index = topk_kernels.top_logprobs(logits, 4, block_n=512)
    want, _ = TORCH_OPS.top_logprobs(logits, 4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.float().gather(1, index), logits.float().topk(4, -1).values)


def test_refuses_what_it_cannot_hold_and_the_ops_fall_back() -> None:
    """k past the unrolled limit or the vocabulary, or no rows, is refused naming the limit; TritonOps then
    takes torch's path with the same result."""
    logits = torch.randn(2, 40)
    for bad in (0, topk_kernels.TOPK_MAX_K + 1):
        with pytest.raises(ValueError, match="1 <= k"):
            topk_kernels.top_logprobs(logits, bad)
    with pytest.raises(ValueError, match="got"):
        topk_kernels.top_logprobs(torch.randn(0, 40), 2)
    big = topk_kernels.TOPK_MAX_K + 4
    got, index = TritonOps().top_logprobs(logits, big)
    want, want_index = TORCH_OPS.top_logprobs(logits, big)
    assert torch.equal(index, want_index) and torch.equal(got, want)


def test_rows_of_nan_still_give_token_ids() -> None:
    """A row whose logits are all NaN matches no maximum; its ids must still lie inside the vocabulary, for
    the steps that embed them next (the greedy-token merge too)."""
    _, index = topk_kernels.top_logprobs(torch.full((2, 3000), float("nan")), 4)
    assert bool(((index >= 0) & (index < 3000)).all())
    vals = torch.full((2, 5), float("nan"))
    tile_ids = torch.arange(10, dtype=torch.int32).view(2, 5)
    out = torch.empty(2, dtype=torch.long)
    argmax_kernels._argmax_of_tiles[(2,)](vals, tile_ids, out, 5, 1000, vals.stride(0), BLOCK_T=8, PDL=False)
    assert bool(((out >= 0) & (out < 1000)).all())
