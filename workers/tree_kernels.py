"""The tree step's bookkeeping in single Triton launches (CUDA; CPU tests via TRITON_INTERPRET).

- `greedy_walk_moves`: `mtpserve.speculative.tree.greedy_walk` takes about nine small torch kernels per tree level,
  and the accepted branch's KV source and destination slots a few more; in a captured step each is a graph
  node that costs launch latency far above its work. Here one program per tree walks from the root, level
  by level: the child whose token is the target's argmax at the current node (the lowest such node, as
  `greedy_walk` picks) is accepted, and the walk stops at the first level without one. It writes what
  `greedy_walk` returns and, for level l, the slot the accepted node's KV moves from (its own slot, or the
  destination when the walk stopped) and the slot of position start + l + 1 it moves to.
- `advance_trees`: a launched tree step's inputs from the previous step's results, `tree_inputs.advance_trees`
  (about twenty launches plus two per level, before every launched step) as one program per sequence.
"""

from __future__ import annotations

import torch

from mtpserve.modeling.fused_kernels import _need_triton
from mtpserve.workers.step_buffers import StepBuffers
from mtpserve.workers.tree_inputs import ResultColumns, TreeBuffers

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _greedy_walk(
        tokens_ptr, parents_ptr, argmax_ptr, slots_ptr, n_acc_ptr, path_ptr, bonus_ptr, src_ptr, dst_ptr,
        Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        i = tl.arange(0, QP)
        row = b * Q
        inside = (i > 0) & (i < Q)
        tokens = tl.load(tokens_ptr + row + i, mask=inside, other=-1)
        parents = tl.load(parents_ptr + row + i, mask=inside, other=-1)
        node = (b * 0).to(tl.int64)  # scalars from the program id: the root, alive, nothing accepted yet
        alive = node == 0
        accepted = node
        for level in tl.static_range(D):
            want = tl.load(argmax_ptr + row + node)
            match = inside & (parents == node) & (tokens == want) & alive
            child = tl.min(tl.where(match, i, QP), 0).to(tl.int64)
            alive = alive & (child < QP)
            node = tl.where(alive, child, node)
            accepted += alive.to(tl.int64)
            tl.store(path_ptr + b * D + level, tl.where(alive, node, 0))
            dst = tl.load(slots_ptr + row + level + 1)
            tl.store(dst_ptr + b * D + level, dst)
            tl.store(src_ptr + b * D + level, tl.where(alive, tl.load(slots_ptr + row + node), dst))
        tl.store(n_acc_ptr + b, accepted)
        tl.store(bonus_ptr + b, tl.load(argmax_ptr + row + node))

    @triton.jit
    def _advance_trees(
        prev_ptr, ids_ptr, pos_ptr, slot_ptr, lens_ptr, tables_ptr, depth_ptr, parents_ptr, mask_ptr,
        stride_prev, stride_bt, block_size, ACC: tl.constexpr, DRAFTS: tl.constexpr, PARENTS: tl.constexpr,
        NEXT: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        i = tl.arange(0, QP)
        inside = i < Q
        row = tl.load(ids_ptr + b * Q)  # the sequence's row in the previous results, written by the host fill
        src = prev_ptr + row * stride_prev
        accepted = tl.load(src + ACC)
        start = tl.load(src + NEXT)
        tokens = tl.load(src + tl.where(i == 0, accepted, DRAFTS + i - 1), mask=inside, other=0)
        pos = start + i
        block = tl.load(tables_ptr + b * stride_bt + pos // block_size, mask=inside, other=0)
        tl.store(ids_ptr + b * Q + i, tokens, mask=inside)
        tl.store(pos_ptr + b * Q + i, pos, mask=inside)
        tl.store(slot_ptr + b * Q + i, block * block_size + pos % block_size, mask=inside)
        tl.store(lens_ptr + b, start + Q)
        up = tl.load(src + PARENTS + i - 1, mask=inside & (i > 0), other=0)  # each node's parent, the root's 0
        tl.store(parents_ptr + b * Q + i, up, mask=inside & (i > 0))  # the root keeps the host's -1
        j = tl.arange(0, QP)
        node = i.to(tl.int64)
        seen = j[None, :] == i[:, None]
        depth = tl.zeros((QP,), tl.int64)
        for _ in tl.static_range(D):  # a node of depth d reaches the root in d steps, then stays there
            depth += (node > 0).to(tl.int64)
            node = tl.load(src + PARENTS + node - 1, mask=inside & (node > 0), other=0)
            seen = seen | (j[None, :] == node[:, None])
        tl.store(depth_ptr + b * Q + i, depth, mask=inside)
        cells = mask_ptr + b * Q * Q + i[:, None] * Q + j[None, :]
        tl.store(cells, seen.to(tl.int64), mask=inside[:, None] & (j[None, :] < Q))


def greedy_walk_moves(
    tokens: torch.Tensor, parents: torch.Tensor, argmax: torch.Tensor, slots: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_walk(tokens, parents, argmax, depth)` for B trees of Q nodes ([B, Q] int64 each, contiguous,
    node 0 the root), plus the accepted branch's KV moves: (accepted [B], path [B, depth], bonus [B],
    src [B, depth], dst [B, depth]), where dst[:, l] = slots[:, l + 1] and src[:, l] = slots at path[:, l]
    while the walk goes on, dst afterwards."""
    _need_triton()
    bsz, q = tokens.shape
    for name, t in (("parents", parents), ("argmax", argmax), ("slots", slots)):
        if tuple(t.shape) != (bsz, q) or not t.is_contiguous() or t.dtype != torch.long:
            raise ValueError(f"{name} must be contiguous int64 {[bsz, q]}, got {t.dtype} {list(t.shape)}")
    if not 1 <= depth < q or not tokens.is_contiguous():
        raise ValueError(f"depth must lie in [1, {q}) and tokens be contiguous, got depth {depth}")
    dev = tokens.device
    n_acc = torch.empty(bsz, dtype=torch.long, device=dev)
    bonus = torch.empty(bsz, dtype=torch.long, device=dev)
    path, src, dst = (torch.empty(bsz, depth, dtype=torch.long, device=dev) for _ in range(3))
    if bsz:
        _greedy_walk[(bsz,)](
            tokens, parents, argmax, slots, n_acc, path, bonus, src, dst, Q=q, QP=triton.next_power_of_2(q), D=depth
        )
    return n_acc, path, bonus, src, dst


def advance_trees(previous: torch.Tensor, cols: ResultColumns, b: StepBuffers, t: TreeBuffers, m: int) -> None:
    """`tree_inputs.advance_trees` in one launch: the first m sequences' tokens, positions, slots, lengths,
    parents, depths and ancestor masks from a previous tree step's results [*, cols.width] on the device."""
    _need_triton()
    q = b.q_len
    if previous.shape[1] != cols.width or previous.stride(1) != 1 or q != cols.budget + 1:
        raise ValueError(
            f"previous results must be [*, {cols.width}] with unit column stride for trees of {q - 1} nodes, "
            f"got {tuple(previous.shape)}"
        )
    if m:
        _advance_trees[(m,)](
            previous, b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.block_tables, t.depth, t.parents,
            t.mask, previous.stride(0), b.block_tables.stride(0), b.block_size, ACC=cols.accepted,
            DRAFTS=cols.drafts.start, PARENTS=cols.parents.start, NEXT=cols.next_start, Q=q,
            QP=triton.next_power_of_2(q), D=cols.depth,
        )  # fmt: skip
