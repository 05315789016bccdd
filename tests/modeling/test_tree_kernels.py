"""The tree step's Triton kernels (`workers/tree_kernels.py`), run on CPU through Triton's interpreter,
against the torch functions they replace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpserve.modeling import fused_kernels
from mtpserve.speculative.tree import greedy_walk
from mtpserve.workers.tree_kernels import greedy_walk_moves

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")


def random_trees(g: torch.Generator, b: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens and parents [b, q] of random trees (parents[:, i] < i, -1 at the root) over a 4-token
    vocabulary, so that walks go deep and siblings may repeat a token."""
    parents = (torch.rand(b, q, generator=g) * torch.arange(q)).long()
    parents[:, 0] = -1
    return torch.randint(0, 4, (b, q), generator=g), parents


def test_the_walk_kernel_is_greedy_walk_with_its_kv_moves() -> None:
    """Accepted counts, paths and bonus tokens equal `greedy_walk` on 60 random batches of trees, and each
    level's KV move reads the accepted node's slot (the destination once the walk stopped) into the slot of
    position start + level + 1."""
    g = torch.Generator().manual_seed(0)
    deep = 0
    for _ in range(60):
        b, q = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 20, (1,), generator=g))
        depth = int(torch.randint(1, q, (1,), generator=g))
        tokens, parents = random_trees(g, b, q)
        argmax = torch.randint(0, 4, (b, q), generator=g)
        slots = torch.randperm(1000, generator=g)[: b * q].view(b, q)
        n_acc, path, bonus = greedy_walk(tokens, parents, argmax, depth)
        got = greedy_walk_moves(tokens, parents, argmax, slots, depth)
        assert torch.equal(got[0], n_acc) and torch.equal(got[1], path) and torch.equal(got[2], bonus)
        accepted = torch.arange(1, depth + 1)[None, :] <= n_acc[:, None]
        assert torch.equal(got[4], slots[:, 1 : depth + 1])
        assert torch.equal(got[3], torch.where(accepted, slots.gather(1, path), slots[:, 1 : depth + 1]))
        deep += int((n_acc >= 2).sum())
    assert deep > 10, "walks past the first level are exercised"


def test_the_walk_kernel_refuses_inputs_it_cannot_read() -> None:
    """Shapes, dtypes and depths it cannot walk are refused naming the field."""
    tokens, parents = random_trees(torch.Generator().manual_seed(1), 2, 5)
    with pytest.raises(ValueError, match="slots"):
        greedy_walk_moves(tokens, parents, tokens, torch.zeros(2, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="argmax"):
        greedy_walk_moves(tokens, parents, tokens.int(), tokens, 2)
    with pytest.raises(ValueError, match="depth"):
        greedy_walk_moves(tokens, parents, tokens, tokens, 5)


COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mtpserve.modeling import topk_kernels
from mtpserve.workers import tree_kernels

I64 = "*i64"
CASES = [
    (tree_kernels._greedy_walk, dict.fromkeys(
        ["tokens_ptr", "parents_ptr", "argmax_ptr", "slots_ptr", "n_acc_ptr", "path_ptr", "bonus_ptr", "src_ptr",
         "dst_ptr"], I64), {"Q": 17, "QP": 32, "D": 4}),
    (tree_kernels._advance_trees, {**dict.fromkeys(
        ["prev_ptr", "ids_ptr", "pos_ptr", "slot_ptr", "lens_ptr", "tables_ptr", "depth_ptr", "parents_ptr",
         "mask_ptr"], I64), "stride_prev": "i32", "stride_bt": "i32", "block_size": "i32"},
     {"ACC": 5, "DRAFTS": 6, "PARENTS": 22, "NEXT": 38, "Q": 17, "QP": 32, "D": 4}),
    (topk_kernels._topk_tiles, {"x_ptr": "*bf16", "val_ptr": "*fp32", "idx_ptr": "*i32", "max_ptr": "*fp32",
     "sum_ptr": "*fp32", "N": "i32", "T": "i32", "stride_x": "i32"}, {"K": 4, "BLOCK_N": 2048}),
    (topk_kernels._topk_merge, {"val_ptr": "*fp32", "idx_ptr": "*i32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
     "out_val_ptr": "*fp32", "out_idx_ptr": "*i64", "N": "i32", "T": "i32"}, {"K": 4, "BLOCK_C": 256, "BLOCK_T": 64}),
]
sizes = {}
for kernel, sig, consts in CASES:
    src = ASTSource(kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    sizes[kernel.fn.__name__] = len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])
print(json.dumps(sizes))
"""


def test_the_kernels_compile_for_an_h200() -> None:
    """The tree step's and the top-k kernels go through Triton's compiler (not its interpreter) to sm_90
    machine code on this CPU-only machine, at a 16-node depth-4 tree's shapes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, check=False, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(sizes) == {"_greedy_walk", "_advance_trees", "_topk_tiles", "_topk_merge"}
    assert all(n > 1000 for n in sizes.values()), sizes
