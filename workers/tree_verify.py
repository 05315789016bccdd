"""The target's side of draft trees: one forward over every node, acceptance along one branch, and the
accepted branch's KV moved to the positions it now holds.

A generation row carrying a tree (`SeqPlan.draft_parents`) puts node i's KV in the slot of position
start + i, rotated for position start + depth(i), and lets node i attend to the prefix and its ancestors.
After acceptance, the accepted nodes a_1 < a_2 < ... < a_n sit at depths 1..n, so their KV only has to move
from the slots of start + a_k to those of start + k: keys are already rotated for those positions.
"""

from __future__ import annotations

import torch

from mtpserve.modeling.kv_cache import KVCache
from mtpserve.speculative.messages import SeqPlan
from mtpserve.speculative.tree import DraftTree, greedy_accept, tree_draws


def plan_trees(seqs: list[SeqPlan]) -> list[DraftTree | None]:
    """Each sequence's draft tree, or None for context chunks and chains."""
    return [
        DraftTree.from_drafts(s.token_ids, s.draft_parents)
        if s.draft_parents is not None and not s.is_context
        else None
        for s in seqs
    ]


def tree_positions(seqs: list[SeqPlan], trees: list[DraftTree | None]) -> torch.Tensor:
    """[T] rotary positions of every scheduled row: consecutive for chunks and chains, by depth in trees."""
    return torch.cat(
        [torch.arange(s.start, s.end) if t is None else t.positions(s.start) for s, t in zip(seqs, trees, strict=True)]
    )


def accept(
    tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None, thresholds: torch.Tensor | None
) -> tuple[list[int], int]:
    """(accepted node indices, bonus token) for one tree: greedy when `probs` is None, else over the target's
    draws from its processed distributions probs [N, V] with the keyed thresholds [D+1] of the tree's depths."""
    if probs is None:
        return greedy_accept(tree, logits.argmax(-1))
    assert thresholds is not None
    return greedy_accept(tree, tree_draws(probs, thresholds.to(probs.device), tree.depth().to(probs.device)))


def branch_moves(seq: SeqPlan, path: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """(source slots, destination slots) that bring an accepted branch's KV to consecutive positions."""
    src, dst = [], []
    for depth, node in enumerate(path, start=1):
        if node != depth:
            src.append(slot_of(seq, seq.start + node, block_size))
            dst.append(slot_of(seq, seq.start + depth, block_size))
    return src, dst


def slot_of(seq: SeqPlan, position: int, block_size: int) -> int:
    """The KV slot of a sequence position."""
    return seq.block_ids[position // block_size] * block_size + position % block_size


def move_branches(cache: KVCache, moves: list[tuple[list[int], list[int]]], device: torch.device) -> None:
    """Apply `branch_moves` of a step's trees to every layer of `cache` in one copy."""
    src = [s for m in moves for s in m[0]]
    if src:
        dst = [d for m in moves for d in m[1]]
        cache.move(torch.tensor(src, device=device), torch.tensor(dst, device=device))
