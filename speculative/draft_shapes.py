"""A request's stored proposals reshaped for a step of another kind (adaptive speculation switching between
chains and a draft tree).

A step verifies the drafts the step before proposed, and proposes its own kind for the next. When the kind
changes, the stored proposals are reshaped first:

- for a chain of depth d: a tree's first branch (each node's first child: the draft's most likely
  continuation, as the chain would have drafted it), cut to d or padded with the last token;
- for a tree: the chain (or another tree's first branch) as the tree's first branch, then padding nodes
  placed breadth-first under the nodes with room (at most `width` children each, none deeper than
  `depth`), each carrying a token none of its siblings carries.

Verification stays lossless whatever the drafted tokens are (greedy accepts only the target's own choices;
rejection sampling over fixed candidates keeps the target's distribution); padding only spends rows.
"""

from __future__ import annotations

from itertools import count

from mtpserve.speculative.adaptive import StepKind


def first_branch(tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens along a tree's first branch: from the root, each node's lowest-numbered child. tokens /
    parents [N] describe drafts 1..N (parents[j] the node draft j+1 continues, 0 = the root, in creation order)."""
    branch: list[int] = []
    node = 0
    while True:
        child = next((j + 1 for j in range(node, len(parents)) if parents[j] == node), None)
        if child is None:
            return branch
        branch.append(tokens[child - 1])
        node = child


def chain_as_tree(chain: list[int], budget: int, depth: int, width: int) -> tuple[list[int], list[int]]:
    """A tree of exactly `budget` drafts whose first branch is `chain` (cut to `depth` and `budget`), padded
    breadth-first; returns (tokens [budget], parents [budget]) in the `first_branch` layout. Raises
    ValueError when a tree of this depth and width cannot hold `budget` nodes."""
    tokens = list(chain[: min(depth, budget)])
    parents = list(range(len(tokens)))  # draft j + 1 continues node j
    node_depth = list(range(len(tokens) + 1))
    child_tokens: list[set[int]] = [{t} for t in tokens] + [set()]
    parent = 0
    while len(tokens) < budget:
        while parent < len(node_depth) and (node_depth[parent] >= depth or len(child_tokens[parent]) >= width):
            parent += 1
        if parent == len(node_depth):
            raise ValueError(f"a tree of depth {depth} and width {width} cannot hold {budget} nodes")
        token = next(t for t in count() if t not in child_tokens[parent])
        child_tokens[parent].add(token)
        tokens.append(token)
        parents.append(parent)
        node_depth.append(node_depth[parent] + 1)
        child_tokens.append(set())
    return tokens, parents


def fit_drafts(
    tokens: list[int], parents: list[int] | None, kind: StepKind, last: int
) -> tuple[list[int], list[int] | None, int | None]:
    """A request's stored drafts (`parents` None for a chain) as the drafts of a step of `kind`, whose input
    token is `last`: (drafts, their parents or None for a chain, real drafts among them or None when the
    drafts are the stored ones, unpadded and in their own shape)."""
    if kind.is_tree:
        if parents is not None and len(tokens) == kind.budget:
            return tokens, parents, None
        chain = first_branch(tokens, parents) if parents is not None else tokens
        chain = chain[: min(kind.depth, kind.budget)]
        drafts, tree = chain_as_tree(chain, kind.budget, kind.depth, kind.width)
        return drafts, tree, len(chain)
    chain = first_branch(tokens, parents) if parents is not None else tokens
    kept = chain[: kind.depth]
    if len(kept) < kind.depth:
        return kept + [last] * (kind.depth - len(kept)), None, len(kept)
    return kept, None, None
