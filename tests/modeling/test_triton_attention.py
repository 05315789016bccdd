"""The Triton paged-attention kernel against a float64 reference (CPU: Triton's interpreter)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.modeling import triton_attention
from mtpserve.modeling.attention import AttentionMetadata, RaggedMetadata, ragged_metadata, uniform_paged_attention

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")


def uniform_case(
    q_len: int, heads: int, kv_heads: int, lens: list[int], seed: int, nb: int, max_blocks: int, early: bool = False
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """Random paged inputs (q, k cache, v cache, block tables, lengths; 16-slot blocks, head size 32), the
    kernel's output and the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    bs, dim = 16, 32
    kc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    vc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    tables = torch.randperm(nb, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens) * q_len, heads, dim, generator=g)
    got = triton_attention.triton_uniform_attention(q, kc, vc, tables, seq_lens, q_len, dim**-0.5, early=early)
    ref = uniform_paged_attention(q.double(), kc.double(), vc.double(), tables, seq_lens, q_len, scale=dim**-0.5)
    return (q, kc, vc, tables, seq_lens), got, ref


@pytest.mark.parametrize(
    ("q_len", "heads", "kv_heads", "lens"),
    [(1, 4, 4, [1, 17, 64]), (4, 9, 3, [4, 37, 80]), (2, 8, 2, [2, 16, 33]), (5, 6, 3, [5, 5, 79])],
)
def test_kernel_matches_float64_reference(q_len: int, heads: int, kv_heads: int, lens: list[int]) -> None:
    _, got, ref = uniform_case(q_len, heads, kv_heads, lens, seed=q_len, nb=24, max_blocks=5)
    assert got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize(
    ("q_len", "heads", "kv_heads", "lens"),
    [(1, 9, 3, [300, 5, 70]), (4, 9, 3, [150, 37]), (3, 4, 2, [80, 200, 16, 33])],
)
def test_split_key_ranges_match_float64_reference(
    q_len: int, heads: int, kv_heads: int, lens: list[int], early: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long sequences split over several programs (ranges of 16 keys, empty trailing ranges included) and
    merged by the last one give the float64 result; a second launch gives the same, with every arrival
    counter back at zero."""
    monkeypatch.setattr(triton_attention, "UNIFORM_TILE", 16)
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 16)
    monkeypatch.setattr(triton_attention._Scratch, "buffers", {})
    assert triton_attention.split_cap(len(lens), kv_heads) > 1
    inputs, got, ref = uniform_case(
        q_len, heads, kv_heads, lens, seed=len(lens) + q_len, nb=80, max_blocks=19, early=early
    )
    assert (got.double() - ref).abs().max().item() < 1e-4
    again = triton_attention.triton_uniform_attention(*inputs, q_len, 32**-0.5, early=early)
    assert torch.equal(got, again)
    ((_, _, counters),) = triton_attention._Scratch.buffers.values()
    assert not counters.any()


@pytest.mark.parametrize(("q_len", "lens"), [(4, [18, 16, 4, 20]), (3, [17, 15, 33]), (1, [16, 17, 1])])
def test_step_rows_in_and_past_the_first_tile_match_float64_reference(
    q_len: int, lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read early (as under PDL), the first key tile comes in two parts (the cached keys before waiting for
    the kernel ahead, the step's own rows after it); with 16-key tiles the step's rows fall inside it,
    across its end, at its end and past it, and each case gives the float64 result, bit for bit the result
    of the plain key loop."""
    monkeypatch.setattr(triton_attention, "UNIFORM_TILE", 16)
    inputs, got, ref = uniform_case(q_len, 6, 3, lens, seed=q_len + 11, nb=24, max_blocks=3, early=True)
    assert (got.double() - ref).abs().max().item() < 1e-4
    plain = triton_attention.triton_uniform_attention(*inputs, q_len, 32**-0.5, early=False)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize(("q_len", "width", "lens"), [(5, 5, [5, 40, 77]), (3, 9, [12, 70]), (4, 64, [64, 90])])
def test_tree_masks_match_float64_reference(q_len: int, width: int, lens: list[int], early: bool) -> None:
    """A random mask over each sequence's last `width` keys (its own row always seen) gives the reference's
    masked result, through the int64 bit rows the kernel reads."""
    assert tree_attention_error(q_len, width, lens, heads=6, kv_heads=3, seed=q_len * width, early=early) < 1e-4


def tree_attention_error(
    q_len: int, width: int, lens: list[int], heads: int, kv_heads: int, seed: int, **kernel: Any
) -> float:
    """Largest difference between the uniform kernel and the float64 reference over a random paged cache,
    with a random tree mask over each sequence's last `width` keys (its own row always seen), read through
    the int64 bit rows the kernel takes; `kernel` goes to the kernel (e.g. early=True). Without a mask
    (width 0) both attend causally."""
    g = torch.Generator().manual_seed(seed)
    bs, dim, nb, max_blocks = 16, 32, 40, 7
    kc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    vc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    tables = torch.randperm(nb, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens) * q_len, heads, dim, generator=g)
    mask = bits = None
    if width:
        mask = torch.rand(len(lens), q_len, width, generator=g) < 0.5
        mask[:, torch.arange(q_len), width - q_len + torch.arange(q_len)] = True
        bits = triton_attention.tree_mask_bits(mask)
    got = triton_attention.triton_uniform_attention(
        q, kc, vc, tables, seq_lens, q_len, dim**-0.5, tree_bits=bits, tree_width=width, **kernel
    )
    ref = uniform_paged_attention(
        q.double(), kc.double(), vc.double(), tables, seq_lens, q_len, scale=dim**-0.5, tree_mask=mask
    )
    return float((got.double() - ref).abs().max())
    causal = uniform_paged_attention(q.double(), kc.double(), vc.double(), tables, seq_lens, q_len, scale=dim**-0.5)
    assert (causal - ref).abs().max().item() > 1e-2, "the mask must matter"


def test_split_cap_fills_the_gpu_only_for_small_batches() -> None:
    """Up to 16 ranges for one sequence, fewer as the batch grows, none once the batch fills the GPU."""
    caps = [triton_attention.split_cap(b, 3) for b in (1, 8, 16, 32, 64, 128)]
    assert caps == sorted(caps, reverse=True) and caps[0] == 16 and caps[-1] == 1 and caps[-2] == 1
    assert all(c & (c - 1) == 0 for c in caps)


def test_kernel_ignores_blocks_past_the_sequence() -> None:
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(8, 16, 2, 32, generator=g)
    vc = torch.randn(8, 16, 2, 32, generator=g)
    tables = torch.tensor([[3, 5, 7]])
    q = torch.randn(1, 2, 32, generator=g)
    a = triton_attention.triton_uniform_attention(q, kc, vc, tables, torch.tensor([20]), 1, 0.2)
    kc[7] = float("nan")  # a block the sequence does not reach
    vc[5, 8:] = float("nan")  # slots past the sequence's length
    b = triton_attention.triton_uniform_attention(q, kc, vc, tables, torch.tensor([20]), 1, 0.2)
    assert torch.equal(a, b)


def ragged_case(
    starts: list[int], counts: list[int], kv_heads: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random paged K/V caches (8-slot blocks of 40, head size 32) and a block table per sequence."""
    bs, dim, nb = 8, 32, 40
    kc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    vc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for s, n in zip(starts, counts, strict=True):
        need = -(-(s + n) // bs)
        tables.append(perm[used : used + need])
        used += need
    return kc, vc, tables


@pytest.mark.parametrize(
    ("heads", "kv_heads", "starts", "counts"),
    [
        (9, 3, [0, 40, 7, 0], [37, 1, 4, 1]),  # a prefill chunk, a decode row, a verify row, a 1-token prompt
        (4, 4, [16, 0], [20, 33]),  # a later chunk and a whole prompt, tiles of 16 with a ragged tail
        (8, 2, [5], [1]),
    ],
)
def test_ragged_kernel_matches_float64_reference(
    heads: int, kv_heads: int, starts: list[int], counts: list[int]
) -> None:
    """Ragged batches (chunks, decode and verify rows together) against the masked-SDPA path in float64."""
    g = torch.Generator().manual_seed(heads + len(starts))
    bs, dim = 8, 32
    kc, vc, tables = ragged_case(starts, counts, kv_heads, g)
    q = torch.randn(sum(counts), heads, dim, generator=g)
    ragged = RaggedMetadata.build(starts, counts, tables, bs)
    dense = AttentionMetadata.build(starts, counts, tables, bs)
    assert torch.equal(ragged.slot_mapping, dense.slot_mapping)
    got = ragged.attend(q, kc, vc, dim**-0.5)
    ref = dense.attend(q.double(), kc.double(), vc.double(), dim**-0.5)
    assert got.shape == ref.shape == (sum(counts), heads * dim)
    assert (got.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("starts", "counts", "width", "trees"),
    [
        ([0, 30, 11], [20, 5, 5], 5, [False, True, True]),  # a prompt chunk beside two tree verifies
        ([12, 40], [3, 3], 9, [True, True]),  # draft-tree rounds: 3 frontier rows over the last 9 keys
    ],
)
def test_ragged_tree_masks_match_the_dense_path(
    starts: list[int], counts: list[int], width: int, trees: list[bool]
) -> None:
    """Tree rows in a ragged step (the kernel's bit rows, and the per-sequence SDPA path) give the dense
    masked path's result in float64; rows without a mask stay causal."""
    g = torch.Generator().manual_seed(width)
    bs, dim, heads = 8, 32, 6
    kc, vc, tables = ragged_case(starts, counts, 3, g)
    masks: list[torch.Tensor | None] = []
    for n, tree in zip(counts, trees, strict=True):
        m = None
        if tree:  # each row sees itself and a random subset of the keys before it, as a tree's rows do
            own = width - n + torch.arange(n)
            m = (torch.rand(n, width, generator=g) < 0.5) & (torch.arange(width)[None, :] < own[:, None])
            m[torch.arange(n), own] = True
        masks.append(m)
    q = torch.randn(sum(counts), heads, dim, generator=g)
    ragged = RaggedMetadata.build(starts, counts, tables, bs, "cpu", masks)
    dense = AttentionMetadata.build(starts, counts, tables, bs, "cpu", masks)
    ref = dense.attend(q.double(), kc.double(), vc.double(), dim**-0.5)
    for got in (
        ragged.attend(q, kc, vc, dim**-0.5),
        ragged.attend_sdpa(q.double(), kc.double(), vc.double(), dim**-0.5),
    ):
        assert (got.double() - ref).abs().max().item() < 1e-4
    causal = AttentionMetadata.build(starts, counts, tables, bs).attend(q.double(), kc.double(), vc.double(), dim**-0.5)
    assert (causal - ref).abs().max().item() > 1e-2, "the masks must matter"


def test_ragged_metadata_is_used_on_cuda_only() -> None:
    """CPU keeps the masked-SDPA path; the Triton metadata is built only for CUDA devices."""
    meta = ragged_metadata([0], [3], [[0]], 4, "cpu")
    assert isinstance(meta, AttentionMetadata)
    with pytest.raises(ValueError, match="needs 9 slots"):
        RaggedMetadata.build([5], [4], [[0, 1]], 4)


@pytest.mark.parametrize("split", [False, True])
def test_query_rows_cut_into_tiles_match_float64_reference(split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify of many rows (17 step rows x 2 heads per KV head, a tree mask over the last 17 keys) cut into
    tiles of 16 query rows, one program each, with and without split key ranges, gives the float64 result,
    and every arrival counter is back at zero."""
    monkeypatch.setattr(triton_attention, "PROGRAM_ROWS", 16)
    monkeypatch.setattr(triton_attention._Scratch, "buffers", {})
    if split:
        monkeypatch.setattr(triton_attention, "UNIFORM_TILE", 16)
        monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 16)
    assert triton_attention.row_tiling(17 * 2) == (16, 3)
    assert tree_attention_error(17, 17, [17, 60, 95], heads=4, kv_heads=2, seed=5) < 1e-4
    assert tree_attention_error(17, 0, [17, 60, 95], heads=4, kv_heads=2, seed=5) < 1e-4
    ((_, _, counters),) = triton_attention._Scratch.buffers.values()
    assert not counters.any()
