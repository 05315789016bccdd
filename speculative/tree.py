"""Draft trees: many candidate continuations verified in one target pass, and greedy acceptance over them.

Terms:
- Node 0 is the root: the last accepted token, whose target forward has not run yet (as in the chain's
  verify, which runs [last token, d1..dK]). Every other node is a drafted token.
- parents[i] is the node that node i continues (parents[0] = -1, parents[i] < i); siblings carry
  distinct tokens. depth[i] is the distance from the root.
- Verify: the target runs all N nodes in one pass. Node i sits at position start + depth[i] and attends
  to the whole prefix and to its own ancestors (and itself), never to other branches: `ancestor_mask`.
- Sampling: the engine's trees hold the draft's top tokens (children chosen deterministically); they are
  walked as greedy trees over the target's keyed draws (`tree_draws`), so the output is the target's own
  sampling. `sample_accept` is recursive rejection sampling for children drawn without replacement from a
  draft distribution (as in recursive speculative decoding). Either way the output follows the target's
  distribution.
- Greedy acceptance: from the root, the target's argmax at node i is the token that follows it. If a
  child of i carries that token, the walk moves there and the token is accepted; otherwise the walk stops
  and the argmax is the bonus token. With a chain (each node one child) this is the longest matching
  prefix plus one, the chain rule of `verify.py`.

`expand_topk` grows a tree EAGLE-2 style: each round expands the frontier nodes with the best cumulative
draft log-probability by their top children, and the tree keeps the `budget` best nodes overall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtpserve.speculative.sampling import sample_at_threshold


@dataclass
class DraftTree:
    """A draft tree in topological order (parents before children)."""

    tokens: torch.Tensor  # [N] int64; tokens[0] is the root (the last accepted token)
    parents: torch.Tensor  # [N] int64; parents[0] = -1, 0 <= parents[i] < i

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape or n == 0:
            raise ValueError(f"tokens and parents must be equal-length 1-D tensors, got {self.tokens.shape}")
        if int(self.parents[0]) != -1:
            raise ValueError("parents[0] must be -1 (node 0 is the root)")
        idx = torch.arange(1, n)
        if bool(((self.parents[1:] < 0) | (self.parents[1:] >= idx)).any()):
            raise ValueError("parents[i] must lie in [0, i) for every node i > 0")
        pairs = {(int(p), int(t)) for p, t in zip(self.parents[1:], self.tokens[1:], strict=True)}
        if len(pairs) != n - 1:
            raise ValueError("siblings must carry distinct tokens")

    @classmethod
    def from_drafts(cls, token_ids: list[int], draft_parents: list[int]) -> DraftTree:
        """The tree of a generation row: token_ids = [root, d1..dN], draft_parents[j] = the node draft j+1
        continues (0 = the root)."""
        return cls(torch.tensor(token_ids, dtype=torch.long), torch.tensor([-1, *draft_parents], dtype=torch.long))

    @property
    def size(self) -> int:
        """Number of nodes, the root included."""
        return self.tokens.numel()

    def depth(self) -> torch.Tensor:
        """[N] int64 distance of each node from the root."""
        d = torch.zeros(self.size, dtype=torch.long)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: row i may attend to node j (j is i or an ancestor of i)."""
        m = torch.eye(self.size, dtype=torch.bool)
        for i in range(1, self.size):
            m[i] |= m[self.parents[i]]
        return m

    def positions(self, start: int) -> torch.Tensor:
        """[N] int64 sequence positions of the nodes when the root sits at `start`."""
        return start + self.depth()

    def children(self, node: int) -> list[int]:
        """Indices of the nodes that continue `node`."""
        return [i for i in range(1, self.size) if int(self.parents[i]) == node]


def greedy_accept(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """(accepted node indices along the walk, root excluded; bonus token) for the target's argmax [N] at each
    node's row.

    Example: root 0 (the last token) with children 1 ("the") and 2 ("a"); node 1 has children 3 ("cat") and
    4 ("dog"). The target's argmax is "the" at row 0, "dog" at row 1 and "sat" at row 4: the walk accepts
    nodes [1, 4] and the bonus "sat", so the step emits "the dog sat"."""
    path: list[int] = []
    node = 0
    while True:
        want = int(target_argmax[node])
        nxt = next((c for c in tree.children(node) if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def greedy_walk(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_accept` for B trees at once, in fixed shapes (safe to capture).

    tokens / parents / target_argmax [B, N] (node 0 the root; parents[:, 0] is ignored), `depth` at least
    the deepest tree's. Returns (accepted counts [B], accepted node indices [B, depth], padded with 0,
    bonus tokens [B])."""
    bsz = tokens.shape[0]
    node = torch.zeros(bsz, dtype=torch.long, device=tokens.device)
    alive = torch.ones(bsz, dtype=torch.bool, device=tokens.device)
    path = []
    is_child = torch.ones_like(parents, dtype=torch.bool)
    is_child[:, 0] = False
    for _ in range(depth):
        want = target_argmax.gather(1, node[:, None])
        match = is_child & (parents == node[:, None]) & (tokens == want) & alive[:, None]
        alive = match.any(dim=1)
        node = torch.where(alive, match.long().argmax(dim=1), node)
        path.append(torch.where(alive, node, 0))
    n_acc = (torch.stack(path, dim=1) > 0).sum(dim=1)
    return n_acc, torch.stack(path, dim=1), target_argmax.gather(1, node[:, None])[:, 0]


def tree_draws(probs: torch.Tensor, thresholds: torch.Tensor, node_depth: torch.Tensor) -> torch.Tensor:
    """The target's draw at every node [..., N]: node i's row sampled at the threshold of its depth's position.

    probs [..., N, V] the target's distribution at each node's row (a one-hot row draws its argmax);
    thresholds [..., D+1], the keyed thresholds of positions start+1..start+D+1; node_depth [..., N]. Walking a
    tree with these draws in place of the argmax (`greedy_accept`, `greedy_walk`) samples it: a child is
    accepted where its token equals its parent's draw, with probability p(token), as recursive rejection
    sampling over deterministic children accepts it, and the emitted tokens are the draws target-only
    decoding makes at those positions. Nodes of one depth share a threshold; only one of them lies on the
    walked branch."""
    return sample_at_threshold(probs, thresholds.gather(-1, node_depth))


def sample_accept(
    tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """(accepted node indices, bonus token) by recursive rejection sampling over the tree.

    target_probs / draft_probs [N, V]: the target's and the draft's next-token distributions at each node's
    row. The children of a node must be draws without replacement from draft_probs[node], in index order.
    At a node, child j is accepted with probability min(1, p(x_j) / q(x_j)); on a rejection the target's
    distribution becomes the normalised residual max(p - q, 0) and the draft's loses x_j (renormalised);
    when every child is rejected the bonus is drawn from the last residual. The emitted tokens are then
    distributed as the target's own sampling would give them.

    Example: the root's children "the" then "a" were drawn from q with q("the") = 0.6, q("a") = 0.3; the
    target has p("the") = 0.3, p("a") = 0.5. "the" is accepted with probability min(1, 0.3 / 0.6) = 0.5. If
    it is rejected, p becomes max(p - q, 0) renormalised ("the" keeps no mass) and q loses "the" (q("a") =
    0.3 / 0.4 = 0.75), and "a" is tried against those; if "a" is rejected too, the bonus is drawn from the
    residual left after both.
    """
    path: list[int] = []
    node = 0
    while True:
        p = target_probs[node].double().clone()
        q = draft_probs[node].double().clone()
        chosen = None
        for c in tree.children(node):
            x = int(tree.tokens[c])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if q[x] > 0 and u * q[x] < p[x]:
                chosen = c
                break
            p = torch.clamp(p - q, min=0.0)
            p /= p.sum()
            q[x] = 0.0
            if q.sum() <= 0:
                break
            q /= q.sum()
        if chosen is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(chosen)
        node = chosen


def expand_topk(
    root_token: int,
    logprobs_of: Callable[[DraftTree, list[int]], torch.Tensor],
    width: int,
    depth: int,
    budget: int,
) -> DraftTree:
    """A tree of at most `budget` drafted nodes (plus the root) over `depth` rounds.

    logprobs_of(tree, nodes) gives the draft's next-token log-probabilities [len(nodes), V] after each of
    `nodes` in the tree grown so far. Each round expands the `width` frontier nodes with the best
    cumulative log-probability by their `width` most likely tokens; at the end the `budget` best nodes by
    cumulative log-probability are kept. A child never scores above its parent (ties go to the lower
    index, which the parent has), so the kept set holds every kept node's ancestors.
    """
    if width < 1 or depth < 1 or budget < 1:
        raise ValueError(f"width, depth and budget must be >= 1, got {width}, {depth}, {budget}")
    tokens, parents, scores = [root_token], [-1], [0.0]
    frontier = [0]
    for _ in range(depth):
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        lp = logprobs_of(tree, frontier)
        top = torch.topk(lp, min(width, lp.shape[-1]), dim=-1)
        grown = []
        for row, node in enumerate(frontier):
            for value, tok in zip(top.values[row].tolist(), top.indices[row].tolist(), strict=True):
                tokens.append(int(tok))
                parents.append(node)
                scores.append(scores[node] + float(value))
                grown.append(len(tokens) - 1)
        frontier = sorted(grown, key=lambda i: (-scores[i], i))[:width]
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    kept = sorted(order)  # parents precede children in index order, so this stays topological
    remap = {0: 0, **{old: new + 1 for new, old in enumerate(kept)}}
    return DraftTree(
        torch.tensor([root_token] + [tokens[i] for i in kept]),
        torch.tensor([-1] + [remap[parents[i]] for i in kept]),
    )


def forced_walk(
    forced: torch.Tensor, target_argmax: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_walk` with the accepted branch read from forced rows [B, >=1+depth]: returns (accepted counts
    [B], node indices [B, depth] padded with 0, bonus tokens [B]: the target's token at the last accepted
    node, or at the root). target_argmax [B, N]."""
    n_acc = forced[:, 0].clamp(0, depth)
    steps = torch.arange(depth, device=forced.device)
    path = torch.where(steps[None, :] < n_acc[:, None], forced[:, 1 : depth + 1], 0)
    last = path.gather(1, (n_acc - 1).clamp(min=0)[:, None])  # node 0 (the root) when nothing is accepted
    return n_acc, path, target_argmax.gather(1, last)[:, 0]
