"""The draft-step kernels against torch (CPU: Triton's interpreter): norm + lm_head + argmax, and the MTP
head's fused input; greedy tokens and head steps through the models with and without them.

The interpreter's `tl.dot` mishandles bf16 operands, so the argmax kernel (tensor-core products) is
checked here in fp32; bench/probes/kernel_check.py checks it in bf16 on the GPU against the separate kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.modeling import argmax_kernels, draft_kernels, fused_kernels
from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.gemv_tiles import GemvTiles
from mtpserve.modeling.layer_ops import TORCH_OPS, TritonOps
from mtpserve.modeling.model import LlamaModel, prepare_for_inference
from mtpserve.speculative.mtp_head import MTPEagleHead
from tests.helpers.tiny import tiny_args, tiny_weights

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")
TRITON = TritonOps()


def _lm_head(vocab: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, d, generator=g).to(dtype), (1.0 + 0.1 * torch.randn(d, generator=g)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(("block_n", "block_k"), [(128, 64), (64, 32)])
def test_norm_argmax_matches_torch_in_fp32(rows: int, block_n: int, block_k: int) -> None:
    """fp32 logits are distinct, so the token must equal torch's argmax exactly (vocab not a multiple of
    the tile, width not a multiple of the chunk)."""
    w, nw = _lm_head(1000, 80, torch.float32, rows)
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(7 + rows))
    got = argmax_kernels.norm_argmax(x, nw, 1e-5, w, block_n=block_n, block_k=block_k)
    want = TORCH_OPS.norm_argmax(x, nw, 1e-5, w)
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, want)


def test_ties_go_to_the_lowest_token_across_tiles() -> None:
    """Equal best logits in two programs' tiles and within one tile: the lowest id wins, as in torch.
    Integer weights and an all-ones input row keep every logit exact, whatever the summation order."""
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-3, 4, (200, 64), generator=g).float()
    nw = torch.randint(-2, 3, (64,), generator=g).float()
    x = torch.ones(2, 64)
    x[1, ::2] = -1.0
    normed = TORCH_OPS.add_rms_norm(x, None, nw, 1e-30)[0]  # inv rms of exactly 1
    w[[150, 37, 38]] = normed[0] * 4  # row 0's best, three times: tiles 1 and 4 (of 32)
    w[[190, 90]] = normed[1] * 4
    got = argmax_kernels.norm_argmax(x, nw, 1e-30, w, block_n=32)
    assert got.tolist() == [37, 90]
    assert torch.equal(got, TORCH_OPS.norm_argmax(x, nw, 1e-30, w))


def test_norm_argmax_refuses_what_it_cannot_hold() -> None:
    """Too many rows or a transposed weight: a clear error, and TritonOps falls back to torch."""
    w, nw = _lm_head(100, 32, torch.float32, 1)
    x = torch.randn(argmax_kernels.ARGMAX_MAX_ROWS + 1, 32)
    with pytest.raises(ValueError, match="norm_argmax takes"):
        argmax_kernels.norm_argmax(x, nw, 1e-5, w)
    assert torch.equal(TRITON.norm_argmax(x, nw, 1e-5, w), TORCH_OPS.norm_argmax(x, nw, 1e-5, w))
    wt = torch.randn(32, 100).t()
    assert not argmax_kernels.norm_argmax_fits(x[:2], wt)
    assert torch.equal(TRITON.norm_argmax(x[:2], nw, 1e-5, wt), TORCH_OPS.norm_argmax(x[:2], nw, 1e-5, wt))


def test_model_greedy_tokens_match_logits_argmax() -> None:
    """`greedy_tokens` equals `logits(...).argmax(-1)` on the torch ops and on the Triton ops (fp32)."""
    args = tiny_args()
    model = LlamaModel(args)
    model.load_hf_state_dict(tiny_weights(args))
    hidden = torch.randn(3, args.hidden_size, generator=torch.Generator().manual_seed(2))
    want = model.logits(hidden).argmax(-1)
    assert torch.equal(model.greedy_tokens(hidden), want)
    prepare_for_inference(model, TRITON)
    assert torch.equal(model.greedy_tokens(hidden), want)
    assert torch.equal(model.greedy_tokens(hidden[:1]), want[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "tiles"), [(1, None), (4, None), (3, GemvTiles(4, 2, row_loop=True))])
def test_draft_input_matches_reference(
    kernels_in_force: Any, dtype: torch.dtype, rows: int, tiles: GemvTiles | None
) -> None:
    """Embedding lookup, both input norms, concat and eh_proj in one launch agree with the five-step
    reference (width not a power of 2, repeated and far-apart token ids), also with other tiles."""
    if tiles is not None:
        kernels_in_force(gemv_tiles={4: tiles})
    g = torch.Generator().manual_seed(rows)
    vocab, d = 300, 96
    emb = torch.randn(vocab, d, generator=g).to(dtype)
    enw, hnw = ((1.0 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    w = (torch.randn(d, 2 * d, generator=g) * 0.1).to(dtype)
    tokens = torch.tensor([299, 0, 299, 17][:rows])
    hidden = torch.randn(rows, d, generator=g).to(dtype)
    weights = draft_kernels.DraftInputWeights(emb, enw, hnw, 1e-5, w)
    got = TRITON.draft_input(tokens, hidden, weights)
    ref = TORCH_OPS.draft_input(tokens, hidden, weights)
    assert got.shape == (rows, d) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (got.float() - ref.float()).abs().max().item() < tol * ref.float().abs().max().item()
    many = torch.randint(0, vocab, (fused_kernels.GEMV_MAX_ROWS + 2,), generator=g)
    big_h = torch.randn(many.shape[0], d, generator=g).to(dtype)
    with pytest.raises(ValueError, match="draft_input takes"):
        draft_kernels.draft_input(many, big_h, weights)
    assert not draft_kernels.draft_input_fits(tokens[:1], hidden, weights) or rows == 1, "one token per row"
    fallback = TRITON.draft_input(many, big_h, weights)
    assert (fallback.float() - TORCH_OPS.draft_input(many, big_h, weights).float()).abs().max() < tol


def test_head_step_matches_forward() -> None:
    """`MTPEagleHead.step` on token ids (fused input on the Triton ops) gives the hidden states and draft KV
    of `forward` on their embeddings."""
    args = tiny_args()
    shared = LlamaModel(args)
    shared.load_hf_state_dict(tiny_weights(args))
    head = MTPEagleHead(args)
    head.init_random(seed=3, std=0.2)
    tokens = torch.tensor([5, 9, 2])
    hidden = torch.randn(3, args.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([7, 8, 9])
    meta = ragged_metadata([7], [3], [[0]], 16, "cpu")
    caches = [head.allocate_cache(2, 16, "cpu") for _ in range(2)]
    want = head(shared.embed(tokens), hidden, positions, caches[0], meta)
    prepare_for_inference(head, TRITON)
    prepare_for_inference(shared, TRITON)
    got = head.step(shared, tokens, hidden, positions, caches[1], meta)
    assert (got - want).abs().max().item() < 1e-4
    assert (caches[1].keys[0] - caches[0].keys[0]).abs().max().item() < 1e-4


def test_greedy_tokens_fall_back_when_the_tile_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU with too little shared memory for the tile: a warning, then the separate kernels, and the
    dtype stays on them."""
    from triton.runtime.errors import OutOfResources

    class Refuses:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                raise OutOfResources(232448, 101376, "shared memory")

            return launch

    monkeypatch.setattr(argmax_kernels, "_norm_argmax_tiles", Refuses())
    monkeypatch.setattr(argmax_kernels, "_UNFIT", set())
    w, nw = _lm_head(300, 64, torch.float32, 4)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(9))
    assert argmax_kernels.norm_argmax_fits(x, w)
    assert torch.equal(TRITON.norm_argmax(x, nw, 1e-5, w), TORCH_OPS.norm_argmax(x, nw, 1e-5, w))
    assert not argmax_kernels.norm_argmax_fits(x, w)
