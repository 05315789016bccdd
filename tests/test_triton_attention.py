"""The Triton paged-attention kernel against a float64 reference (CPU: Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from workers import triton_attention
from workers.attention import uniform_paged_attention

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")


@pytest.mark.parametrize(
    ("q_len", "heads", "kv_heads", "lens"),
    [(1, 4, 4, [1, 17, 64]), (4, 9, 3, [4, 37, 80]), (2, 8, 2, [2, 16, 33]), (5, 6, 3, [5, 5, 79])],
)
def test_kernel_matches_float64_reference(q_len: int, heads: int, kv_heads: int, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(q_len)
    nb, bs, dim, max_blocks = 24, 16, 32, 5
    kc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    vc = torch.randn(nb, bs, kv_heads, dim, generator=g)
    tables = torch.randperm(nb, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens) * q_len, heads, dim, generator=g)
    got = triton_attention.triton_uniform_attention(q, kc, vc, tables, seq_lens, q_len, dim**-0.5)
    ref = uniform_paged_attention(q.double(), kc.double(), vc.double(), tables, seq_lens, q_len, dim**-0.5)
    assert got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() < 1e-4


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
