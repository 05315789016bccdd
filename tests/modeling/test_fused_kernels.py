"""Fused Triton layer kernels against the torch reference ops (CPU: Triton's interpreter), and a whole
model run with them against the same model on torch ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.modeling import fused_kernels
from mtpserve.modeling.attention import AttentionMetadata, RaggedMetadata, UniformMetadata
from mtpserve.modeling.gemv_tiles import GemvTiles, parse_table
from mtpserve.modeling.kernel_choices import KernelChoices
from mtpserve.modeling.kv_cache import KVWrite
from mtpserve.modeling.layer_ops import TORCH_OPS, TritonOps, pick_ops
from mtpserve.modeling.model import LlamaModel, Rotary
from tests.helpers.tiny import tiny_args, tiny_weights

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")
TRITON = TritonOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    """Normed rows and the new residual agree with torch, including a width that is not a power of 2."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype) if with_residual else None
    w = (1.0 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    got, got_res = TRITON.add_rms_norm(x, res, w, 1e-5)
    ref, ref_res = TORCH_OPS.add_rms_norm(x, res, w, 1e-5)
    assert got.dtype == dtype and got.shape == ref.shape
    # Triton's CPU interpreter truncates when casting to bf16 where CUDA rounds to nearest: allow one ulp.
    ulp = 0.0 if dtype == torch.float32 else 2.0**-7
    assert ((got_res.float() - ref_res.float()).abs() <= ulp * ref_res.float().abs()).all()
    rel = 1e-5 if dtype == torch.float32 else 2.0**-6
    assert ((got.float() - ref.float()).abs() <= rel * ref.float().abs() + 1e-5).all()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (9, 3), (2, 2)])
def test_rope_write_kv_matches_reference(heads: int, kv_heads: int) -> None:
    """Rotated q, and every cache slot (written or not), agree with the torch path."""
    g = torch.Generator().manual_seed(heads)
    t, dim, blocks, bs = 6, 32, 5, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.tensor([0, 1, 2, 9, 30, 31])
    cos, sin = Rotary(dim, 10000.0, 64).table(positions)
    slots = torch.tensor([3, 4, 5, 17, 8, 19])
    caches = [torch.randn(blocks, bs, kv_heads, dim, generator=g) for _ in range(2)]
    k1, v1 = (c.clone() for c in caches)
    k2, v2 = (c.clone() for c in caches)
    got = TRITON.rope_write_kv(qkv, KVWrite(cos, sin, slots, k1, v1, heads, kv_heads, dim))
    ref = TORCH_OPS.rope_write_kv(qkv, KVWrite(cos, sin, slots, k2, v2, heads, kv_heads, dim))
    assert got.shape == ref.shape == (t, heads, dim)
    assert (got - ref).abs().max().item() < 1e-5
    assert (k1 - k2).abs().max().item() < 1e-5 and torch.equal(v1, v2)
    untouched = caches[0].view(-1, kv_heads, dim)[0]
    assert not torch.equal(k1, caches[0]) and torch.equal(k1.view(-1, kv_heads, dim)[0], untouched)
    empty = positions[:0]
    none = TRITON.rope_write_kv(
        qkv[:0], KVWrite(*Rotary(dim, 10000.0, 64).table(empty), empty, k1, v1, heads, kv_heads, dim)
    )
    assert none.shape == (0, heads, dim)  # an empty step writes nothing and returns no rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    """silu(gate) * up agrees with torch, across several column blocks."""
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(5, 2 * 1536, generator=g)).to(dtype)
    got, ref = TRITON.silu_mul(x), TORCH_OPS.silu_mul(x)
    assert got.shape == ref.shape == (5, 1536)
    rel = 1e-5 if dtype == torch.float32 else 2.0**-6
    assert ((got.float() - ref.float()).abs() <= rel * ref.float().abs() + 1e-5).all()


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within float rounding of the reference: accumulation order differs, and bf16 rounds its inputs."""
    scale = ref.float().abs().max().item()
    tol = 1e-5 * scale + 1e-5 if dtype == torch.float32 else 2.0**-6 * scale
    return (got.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_linear_matches_reference(dtype: torch.dtype, with_residual: bool, rows: int) -> None:
    """Add + RMSNorm + projection in one kernel equals add_rms_norm then F.linear, for an output width that
    is not a multiple of the column block and an input width that is not a power of 2."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    nw = (1.0 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    w = (0.05 * torch.randn(100, 576, generator=g)).to(dtype)
    got, got_res = fused_kernels.norm_linear(x, res, nw, 1e-5, w)
    ref, ref_res = TORCH_OPS.norm_linear(x, res, nw, 1e-5, w)
    assert got.shape == ref.shape == (rows, 100) and got.dtype == dtype
    assert _close(got, ref, dtype)
    if with_residual:
        assert _close(got_res, ref_res, dtype) and got_res.data_ptr() != x.data_ptr()
    else:
        assert got_res is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_linear_matches_reference(dtype: torch.dtype) -> None:
    """silu(gate) * up and the down projection in one kernel equal silu_mul then F.linear."""
    g = torch.Generator().manual_seed(3)
    gate_up = (2 * torch.randn(3, 2 * 1536, generator=g)).to(dtype)
    w = (0.05 * torch.randn(76, 1536, generator=g)).to(dtype)
    got, ref = fused_kernels.swiglu_linear(gate_up, w), TORCH_OPS.swiglu_linear(gate_up, w)
    assert got.shape == ref.shape == (3, 76)
    assert _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_linear_adds_the_residual_as_a_separate_add_would(dtype: torch.dtype) -> None:
    """With a residual, the kernel returns its own output plus that residual added afterwards (exactly in
    fp32; in bf16 within rounding, since Triton's CPU interpreter truncates where the GPU rounds to
    nearest), and the torch ops agree with it."""
    g = torch.Generator().manual_seed(4)
    gate_up = (2 * torch.randn(4, 2 * 96, generator=g)).to(dtype)
    w = (0.1 * torch.randn(40, 96, generator=g)).to(dtype)
    residual = (4 * torch.randn(4, 40, generator=g)).to(dtype)
    got = fused_kernels.swiglu_linear(gate_up, w, residual)
    separate = fused_kernels.swiglu_linear(gate_up, w) + residual
    assert torch.equal(got, separate) if dtype == torch.float32 else _close(got, separate, dtype)
    assert _close(got, TORCH_OPS.swiglu_linear(gate_up, w, residual), dtype)
    with pytest.raises(ValueError, match="residual"):
        fused_kernels.swiglu_linear(gate_up, w, residual[:, :8])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "rows", "with_residual", "dtype"),
    [(9, 3, 64, 1, True, torch.float32), (4, 2, 16, 3, False, torch.float32), (9, 3, 64, 4, True, torch.bfloat16)],
)
def test_norm_qkv_rope_matches_reference(
    heads: int, kv_heads: int, dim: int, rows: int, with_residual: bool, dtype: torch.dtype
) -> None:
    """Norm, q/k/v projection, RoPE and the paged KV write in one kernel give the torch path's rotated q,
    residual and caches (slots written and untouched), grouped-query heads included."""
    g = torch.Generator().manual_seed(heads + rows)
    d, blocks, bs = 96, 5, 4
    x = torch.randn(rows, d, generator=g).to(dtype)
    res = torch.randn(rows, d, generator=g).to(dtype) if with_residual else None
    nw = (1.0 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    w = (0.1 * torch.randn((heads + 2 * kv_heads) * dim, d, generator=g)).to(dtype)
    positions = torch.tensor([3, 17, 30, 31][:rows])
    cos, sin = Rotary(dim, 10000.0, 64).table(positions)
    slots = torch.tensor([5, 9, 18, 19][:rows])
    caches = [torch.randn(blocks, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
    k1, v1 = (c.clone() for c in caches)
    k2, v2 = (c.clone() for c in caches)
    args = (heads, kv_heads, dim)
    got, got_res = fused_kernels.norm_qkv_rope(x, res, nw, 1e-5, w, KVWrite(cos, sin, slots, k1, v1, *args))
    ref, ref_res = TORCH_OPS.norm_qkv_rope(x, res, nw, 1e-5, w, KVWrite(cos, sin, slots, k2, v2, *args))
    assert got.shape == ref.shape == (rows, heads, dim) and got.dtype == dtype
    assert _close(got, ref, dtype) and _close(got_res, ref_res, dtype)
    assert _close(k1, k2, dtype) and _close(v1, v2, dtype)
    assert not torch.equal(k1, caches[0])
    assert torch.equal(k1.view(-1, kv_heads, dim)[0], caches[0].view(-1, kv_heads, dim)[0])


@pytest.mark.parametrize("rows", [1, 4])
def test_linear_matches_reference(rows: int) -> None:
    """The plain matrix-vector projection (attention output) equals F.linear, in bf16 within rounding."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(rows, 576, generator=g).bfloat16(), (0.05 * torch.randn(70, 576, generator=g)).bfloat16()
    got, ref = fused_kernels.linear(x, w), TORCH_OPS.linear(x, w)
    assert got.shape == ref.shape == (rows, 70) and _close(got, ref, torch.bfloat16)


TILE_CASES = [
    GemvTiles(2, 1),
    GemvTiles(16, 2),
    GemvTiles(8, 0, True),
    GemvTiles(8, 0, group=1),
    GemvTiles(4, 2, group=2),
]


@pytest.mark.parametrize("tiles", TILE_CASES)
def test_other_tiles_compute_the_same_products(kernels_in_force: Any, tiles: GemvTiles) -> None:
    """A row count given other tiles (output columns and warps per program, rows one at a time) still matches
    the torch ops in every matrix-vector kernel; the other row counts keep theirs; a head size the tiles
    cannot split into rotation pairs is refused by rope_fits."""
    kernels_in_force(gemv_tiles={4: tiles})
    assert fused_kernels.gemv_tiles(3) == tiles and fused_kernels.gemv_tiles(2) == GemvTiles()
    g = torch.Generator().manual_seed(6)
    x, r = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    nw, w = 1.0 + 0.1 * torch.randn(96, generator=g), 0.1 * torch.randn(50, 96, generator=g)
    assert _close(fused_kernels.linear(x, w), TORCH_OPS.linear(x, w), torch.float32)
    got, ref = fused_kernels.norm_linear(x, r, nw, 1e-5, w), TORCH_OPS.norm_linear(x, r, nw, 1e-5, w)
    assert _close(got[0], ref[0], torch.float32) and _close(got[1], ref[1], torch.float32)
    gate_up, wd = torch.randn(3, 2 * 48, generator=g), 0.1 * torch.randn(40, 48, generator=g)
    assert _close(fused_kernels.swiglu_linear(gate_up, wd), TORCH_OPS.swiglu_linear(gate_up, wd), torch.float32)
    heads, kv_heads, dim = 4, 2, 16
    wqkv = 0.1 * torch.randn((heads + 2 * kv_heads) * dim, 96, generator=g)
    cos, sin = Rotary(dim, 10000.0, 64).table(torch.tensor([3, 4, 5]))
    caches = [[torch.zeros(4, 4, kv_heads, dim) for _ in range(2)] for _ in range(2)]
    outs = [
        ops(x, r, nw, 1e-5, wqkv, KVWrite(cos, sin, torch.tensor([1, 2, 3]), *cache, heads, kv_heads, dim))
        for ops, cache in zip((fused_kernels.norm_qkv_rope, TORCH_OPS.norm_qkv_rope), caches, strict=True)
    ]
    assert _close(outs[0][0], outs[1][0], torch.float32)
    assert all(_close(a, b, torch.float32) for a, b in zip(caches[0], caches[1], strict=True))
    assert fused_kernels.rope_fits(3, 96, dim) == (dim % tiles.block_n == 0)


def test_matrix_vector_kernels_refuse_what_they_cannot_hold() -> None:
    """More rows than a tile, or rows wider than GEMV_MAX_K, raise naming the limits; TritonOps then keeps
    the separate kernels and still matches the reference."""
    g = torch.Generator().manual_seed(4)
    wide = fused_kernels.GEMV_MAX_K + 64
    x, nw, w = torch.randn(2, wide, generator=g), torch.ones(wide), 0.05 * torch.randn(20, wide, generator=g)
    with pytest.raises(ValueError, match="rows of width"):
        fused_kernels.norm_linear(x, None, nw, 1e-5, w)
    with pytest.raises(ValueError, match="rows of width"):
        fused_kernels.swiglu_linear(torch.randn(fused_kernels.GEMV_MAX_ROWS + 1, 64), torch.randn(8, 32))
    got, _ = TRITON.norm_linear(x, None, nw, 1e-5, w)
    assert _close(got, TORCH_OPS.norm_linear(x, None, nw, 1e-5, w)[0], torch.float32)


def test_small_steps_take_the_matrix_vector_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonOps folds the norm and SwiGLU into the projections up to the rows the kernels take (4 without
    grouped tiles), and keeps the separate kernels (cuBLAS projections) above them."""
    calls: list[str] = []
    for name in ("norm_linear", "swiglu_linear", "linear", "add_rms_norm", "silu_mul"):
        real = getattr(fused_kernels, name)
        monkeypatch.setattr(fused_kernels, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    ops = TritonOps()
    monkeypatch.setattr(TritonOps, "add_rms_norm", staticmethod(fused_kernels.add_rms_norm))
    monkeypatch.setattr(TritonOps, "silu_mul", staticmethod(fused_kernels.silu_mul))
    w, nw = torch.randn(16, 32), torch.ones(32)
    for rows in (fused_kernels.gemv_max_rows(), fused_kernels.gemv_max_rows() + 1):
        x = torch.randn(rows, 32)
        ops.norm_linear(x, None, nw, 1e-5, w)
        ops.swiglu_linear(x, w[:, :16])
        ops.linear(x, w)
    assert calls == ["norm_linear", "swiglu_linear", "linear", "add_rms_norm", "silu_mul"]


def _model(ops: object) -> LlamaModel:
    args = tiny_args()
    model = LlamaModel(args)
    model.load_hf_state_dict(tiny_weights(args))
    return model.eval().prepare_for_inference(ops)  # type: ignore[arg-type]


@torch.no_grad()
@pytest.mark.parametrize(("small_rows", "table"), [(0, ""), (4, ""), (32, "4=8x0g2,8=4x0g4")])
def test_model_with_fused_kernels_matches_torch_ops(small_rows: int, table: str) -> None:
    """A mixed prefill/decode batch (masked SDPA vs the ragged Triton kernel) and a uniform verify step give
    the same hidden states and caches, with the matrix-vector kernels (4-row verify), without them, and with
    their rows in groups (the 8-row batch too)."""
    ops = TritonOps()
    ops.small_rows = small_rows
    ref_model, fused_model = _model(TORCH_OPS), _model(ops)
    fused_model.kernel_choices = KernelChoices(gemv_tiles=parse_table(table))
    assert ref_model.layers[0].self_attn.qkv_weight is not None  # type: ignore[union-attr]
    bs = 8
    starts, counts, tables = [0, 5], [5, 3], [[0, 1], [2]]
    ids = torch.tensor([5, 9, 17, 3, 40, 11, 12, 60])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    outs, caches = [], []
    metas = [AttentionMetadata.build(starts, counts, tables, bs), RaggedMetadata.build(starts, counts, tables, bs)]
    for m, meta in zip((ref_model, fused_model), metas, strict=True):
        cache = m.allocate_cache(4, bs, "cpu")
        h = m(ids, positions, cache, meta)
        uni = UniformMetadata(
            slot_mapping=torch.tensor([8, 9, 16, 17]),
            block_tables=torch.tensor([[0, 1], [2, 3]]),
            seq_lens=torch.tensor([10, 2]),
            q_len=2,
        )
        h2 = m(torch.tensor([7, 8, 1, 2]), torch.tensor([8, 9, 0, 1]), cache, uni)
        outs.append((h, h2, m.logits(h2)))
        caches.append(cache)
    for a, b in zip(outs[0], outs[1], strict=True):
        assert (a - b).abs().max().item() < 1e-4
    for ka, kb in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True):
        assert (ka - kb).abs().max().item() < 1e-5


def test_fused_weights_are_views_and_ops_follow_the_device() -> None:
    """After fusing, q/k/v and gate/up weights share the fused storage; CPU always gets torch ops."""
    model = _model(TORCH_OPS)
    att, mlp = model.layers[0].self_attn, model.layers[0].mlp  # type: ignore[union-attr]
    assert att.q_proj.weight.data_ptr() == att.qkv_weight.data_ptr()  # type: ignore[union-attr]
    assert mlp.up_proj.weight.data_ptr() > mlp.gate_up_weight.data_ptr()  # type: ignore[union-attr]
    assert torch.equal(mlp.gate_up_weight[: mlp.gate_proj.weight.shape[0]], mlp.gate_proj.weight)  # type: ignore
    assert pick_ops("cpu") is TORCH_OPS and pick_ops("cuda", fused_kernels_enabled=False) is TORCH_OPS
