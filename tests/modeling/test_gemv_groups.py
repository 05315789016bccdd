"""Row groups of the matrix-vector kernels (tiles `gN`: N rows per program, the grid's second axis): the
kernels against the torch ops for steps of 1-32 rows (CPU: Triton's interpreter, fp32), the same row
summed alike whatever its step's size, which steps take the kernels, and the table rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.modeling import fused_kernels
from mtpserve.modeling.gemv_tiles import ROW_COUNTS, GemvTiles, parse_table
from mtpserve.modeling.kernel_choices import KernelChoices
from mtpserve.modeling.kv_cache import KVWrite
from mtpserve.modeling.layer_ops import TORCH_OPS, TorchOps, TritonOps
from mtpserve.modeling.model import Rotary, prepare_for_inference
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")
HEADS, KV_HEADS, DIM, WIDTH = 4, 2, 16, 80


def _grouped(tiles: GemvTiles) -> dict[int, GemvTiles]:
    return dict.fromkeys(ROW_COUNTS, tiles)


def _inputs(m: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(m, WIDTH, generator=g),
        "r": torch.randn(m, WIDTH, generator=g),
        "nw": 1.0 + 0.1 * torch.randn(WIDTH, generator=g),
        "w": 0.1 * torch.randn(70, WIDTH, generator=g),  # 70 columns: not a multiple of any tile
        "gate_up": 2 * torch.randn(m, 2 * 72, generator=g),
        "wd": 0.1 * torch.randn(40, 72, generator=g),
        "rd": torch.randn(m, 40, generator=g),
        "wqkv": 0.1 * torch.randn((HEADS + 2 * KV_HEADS) * DIM, WIDTH, generator=g),
        "pos": torch.arange(m) + 3,
    }


def _all_outputs(ops: TorchOps, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every projection kernel's outputs for the rows in t: linear, norm_linear (output, residual),
    swiglu_linear (with and without residual), norm_qkv_rope (q, new residual, both caches)."""
    m = t["x"].shape[0]
    cos, sin = Rotary(DIM, 10000.0, 64).table(t["pos"])
    caches = [torch.zeros(m, 1, KV_HEADS, DIM) for _ in range(2)]
    kv = KVWrite(cos, sin, torch.arange(m), *caches, HEADS, KV_HEADS, DIM)
    q, res = ops.norm_qkv_rope(t["x"], t["r"], t["nw"], 1e-5, t["wqkv"], kv)
    return [
        ops.linear(t["x"], t["w"]),
        *ops.norm_linear(t["x"], t["r"], t["nw"], 1e-5, weight=t["w"]),
        ops.swiglu_linear(t["gate_up"], t["wd"]),
        ops.swiglu_linear(t["gate_up"], t["wd"], t["rd"]),
        q.reshape(m, -1),
        res,
        *(c.reshape(m, -1) for c in caches),
    ]


@pytest.mark.parametrize(
    ("tiles", "rows"),
    [(GemvTiles(16, 0, group=1), 5), (GemvTiles(16, 2, True, group=2), 3), (GemvTiles(16, 2, True, group=2), 17),
     (GemvTiles(32, 0, group=4), 1), (GemvTiles(32, 0, group=4), 32)],
)  # fmt: skip
def test_grouped_rows_match_the_torch_ops(kernels_in_force: Any, tiles: GemvTiles, rows: int) -> None:
    """Every matrix-vector kernel with its rows split into groups equals the torch reference in fp32 within
    rounding, for one row, a partial group, whole groups and many groups (each group's residual stored
    once, every group's q/k/v rotated and written at its own slots)."""
    kernels_in_force(gemv_tiles=_grouped(tiles))
    ops = TritonOps()
    assert all(ops._small(torch.zeros(rows, WIDTH), w) for w in (torch.zeros(70, WIDTH), torch.zeros(40, 72)))
    t = _inputs(rows, rows)
    got, want = _all_outputs(ops, t), _all_outputs(TORCH_OPS, t)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item() + 1e-6


def test_a_row_sums_alike_whatever_the_step_size(kernels_in_force: Any) -> None:
    """With one-row groups, a row's outputs are bit-for-bit the same computed alone (a decode step), among 4
    rows, or among 32 (a tree verify): each is summed by a program of the same shape."""
    kernels_in_force(gemv_tiles=_grouped(GemvTiles(32, 0, group=1)))
    ops = TritonOps()
    big = _inputs(32, 9)
    whole = _all_outputs(ops, big)
    for lo, hi in ((7, 8), (12, 17)):
        part = _all_outputs(ops, {k: v[lo:hi] if v.shape[0] == 32 else v for k, v in big.items()})
        for a, b in zip(part, whole, strict=True):
            assert torch.equal(a, b[lo:hi])


def test_steps_past_four_rows_take_the_kernels_only_in_groups(kernels_in_force: Any) -> None:
    """Without tiles for them, steps of 5 or more rows keep cuBLAS; a table that groups 8-row steps opens the
    kernels to steps of up to 8; larger row counts refuse tiles without groups, naming the item; a group
    holds 1, 2 or 4 rows."""
    assert fused_kernels.gemv_max_rows() == 4 and not fused_kernels.gemv_fits(5, 64)
    kernels_in_force(gemv_tiles=parse_table("4=8x0r,8=8x2g4"))
    assert fused_kernels.gemv_max_rows() == 8 and fused_kernels.gemv_fits(8, 64) and not fused_kernels.gemv_fits(9, 64)
    with pytest.raises(ValueError, match="need groups"):
        parse_table("16=8x0")
    for bad in ("8x0g3", "8x0g8", "8x0g"):
        with pytest.raises(ValueError):
            GemvTiles.parse(bad)
    tiles = GemvTiles.parse("4x2rg2")
    assert tiles == GemvTiles(4, 2, True, 2) and tiles.text() == "4x2rg2"
    assert [tiles.rows_per_program(m) for m in (1, 3, 9)] == [1, 2, 2]
    assert [GemvTiles().rows_per_program(m) for m in (1, 3, 4)] == [1, 4, 4]


@torch.no_grad()
def test_a_tree_verified_in_row_groups_keeps_target_only_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft-tree engine whose target runs every step through the matrix-vector kernels in one-row groups
    (its 9-row tree verify and 14-row prompt included; Triton interpreted, fp32) emits target-only's greedy
    tokens and accepts drafts."""
    args, w = mimic_target()
    prompts = random_prompts(1, args.vocab_size, [14], seed=5)
    want = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 8})]
    spec = {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3}
    eng = tiny_engine(args, w, mimic_head(args, w), scheduler={"max_num_batched_tokens": 128}, speculative=spec)
    runner: Any = eng.target
    prepare_for_inference(runner.model, TritonOps())
    grouped = parse_table("1=16x0g1,2=16x0g1,4=16x0g1,8=16x0g1,16=16x0g1,32=16x0g1")
    runner.model.kernel_choices = KernelChoices(gemv_tiles=grouped)  # the target's, and so its draft's
    calls: list[int] = []
    real = fused_kernels.norm_linear
    monkeypatch.setattr(fused_kernels, "norm_linear", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    got = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 8})]
    assert got == want
    assert 9 in calls, "a tree verify (8 nodes and the root) went through the grouped kernels"
    assert eng.totals.accepted > 0
