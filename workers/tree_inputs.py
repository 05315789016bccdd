"""Fixed-address inputs of a tree step, and a launched tree step's inputs taken from the previous one's results.

A tree step reads, besides the `StepBuffers` every uniform step has, each row's depth and parent and each
tree's ancestor mask (`TreeBuffers`). The host fills them from a plan's `draft_parents`; a tree step launched
before the previous one has been read takes them on the device instead (`advance_trees`): from that step's
packed results (`ResultColumns`) it gets each request's next tokens (the bonus token, then the N drafted
nodes), positions, KV slots and length, and its next tree's parents, depths and ancestor mask (found by
walking up the parent chain once per level, in fixed shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mtpserve.workers.step_buffers import HOST_TWINS, StepBuffers


@dataclass(frozen=True)
class ResultColumns:
    """Where each field lies in a tree step's packed results [m, width], per row:
    [emitted D+1 | accepted | drafts N | parents N | next start | depth of the tree verified]."""

    depth: int  # D, the deepest a tree can be
    budget: int  # N, drafted nodes per tree

    @property
    def accepted(self) -> int:
        """Column of the accepted count (the emitted tokens are the columns before it, the bonus last)."""
        return self.depth + 1

    @property
    def drafts(self) -> slice:
        """Columns of the next tree's drafted tokens."""
        return slice(self.depth + 2, self.depth + 2 + self.budget)

    @property
    def parents(self) -> slice:
        """Columns of the next tree's parents (0 = the root, j = draft j)."""
        return slice(self.depth + 2 + self.budget, self.depth + 2 + 2 * self.budget)

    @property
    def next_start(self) -> int:
        """Column of the next step's first position."""
        return self.depth + 2 + 2 * self.budget

    @property
    def verified_depth(self) -> int:
        """Column of the depth of the tree this step verified."""
        return self.next_start + 1

    @property
    def width(self) -> int:
        """Columns in all."""
        return self.next_start + 2


class TreeBuffers:
    """Fixed-address tree inputs: each row's depth and parent, and each tree's ancestor mask, sent in one copy
    from one of HOST_TWINS rotating host twins (so a step can be filled while the copies of the steps launched before
    it are waiting)."""

    def __init__(self, max_batch: int, q_len: int, device: torch.device) -> None:
        self.max_batch, self.q_len = max_batch, q_len
        rows = max_batch * q_len
        self.packed = torch.zeros(2 * rows + rows * q_len, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.stagings = tuple(
            torch.zeros(self.packed.shape, dtype=torch.long, pin_memory=pin) for _ in range(HOST_TWINS)
        )
        self.turn = 0  # the host twin the current step uses
        depth, parents, mask = self.packed.split([rows, rows, rows * q_len])
        self.depth = depth.view(max_batch, q_len)  # [B_max, Q]
        self.parents = parents.view(max_batch, q_len)  # [B_max, Q], -1 at the root
        self.mask = mask.view(max_batch, q_len, q_len)  # [B_max, Q, Q] 0/1, row i sees node j
        self.nodes = torch.arange(q_len, device=device)  # [Q] node ids, for `advance_trees`
        self._pad_parents = np.array([-1] + [0] * (q_len - 1), dtype=np.int64)
        self._eye = np.eye(q_len, dtype=np.int64)
        self.fill(np.zeros((0, q_len), dtype=np.int64), max_batch)

    def fill(self, parents: np.ndarray, bucket: int) -> np.ndarray:
        """Copy the trees of n sequences (parents [n, Q] int64, -1 at the root, parents[:, i] < i) into the
        first rows; padding rows (up to `bucket`) see only themselves. Returns the depths [n, Q]."""
        n = parents.shape[0]
        depth, par, mask = self._stage(n, bucket)
        if n:
            seen = ancestor_masks(parents)
            mask[:n] = seen
            depth[:n] = seen.sum(-1) - 1
            par[:n] = parents
        self._send(bucket)
        return depth[:n].copy()

    def fill_launched(self, n: int, bucket: int) -> None:
        """`fill` for a step whose n trees `advance_trees` writes on the device: only the padding rows (up to
        `bucket`) and the roots' parent (-1) are written here."""
        _, par, _ = self._stage(n, bucket)
        par[:n, 0] = -1
        self._send(bucket)

    def _stage(self, n: int, bucket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Switch to the next host twin, pad rows n..bucket there; returns its (depth, parents, mask) views."""
        q, rows = self.q_len, self.max_batch * self.q_len
        self.turn = (self.turn + 1) % HOST_TWINS
        host = self.stagings[self.turn].numpy()
        depth = host[:rows].reshape(-1, q)
        par = host[rows : 2 * rows].reshape(-1, q)
        mask = host[2 * rows :].reshape(-1, q, q)
        depth[n:bucket] = 0
        par[n:bucket] = self._pad_parents
        mask[n:bucket] = self._eye
        return depth, par, mask

    def _send(self, bucket: int) -> None:
        """Copy the current host twin's used prefix: depths and parents of every row, masks of the bucket's."""
        used = 2 * self.max_batch * self.q_len + bucket * self.q_len * self.q_len
        self.packed[:used].copy_(self.stagings[self.turn][:used], non_blocking=True)


def ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """[n, Q, Q] bool: node i of tree b sees node j (j is i or one of its ancestors), for parents [n, Q]
    (-1 at the root, parents[:, i] < i)."""
    n, q = parents.shape
    seen = np.zeros((n, q, q), dtype=bool)
    seen[:, np.arange(q), np.arange(q)] = True
    if q > 1:
        seen[np.arange(n)[:, None], np.arange(1, q)[None, :], parents[:, 1:]] = True
    for _ in range((q - 2).bit_length() if q > 2 else 0):  # each squaring doubles the path length covered
        seen = seen @ seen
    return seen


def advance_trees(previous: torch.Tensor, cols: ResultColumns, b: StepBuffers, t: TreeBuffers, m: int) -> None:
    """Overwrite the first m sequences' inputs in `b` and `t` from a previous tree step's results `previous`
    [*, cols.width] on the device: each sequence's first token slot holds its row there. Its tokens become
    [bonus, drafts], its positions start + i, its tree the row's parents (depths and ancestor mask from
    them); the root's parent stays the -1 the host wrote (`TreeBuffers.fill_launched`)."""
    q, bs = b.q_len, b.block_size
    src = previous.index_select(0, b.input_ids.view(-1, q)[:m, 0])  # [m, width]
    n_acc = src[:, cols.accepted : cols.accepted + 1]
    parents = src[:, cols.parents]
    start = src[:, cols.next_start : cols.next_start + 1]
    pos = start + t.nodes
    b.input_ids[: m * q].view(m, q).copy_(torch.cat([src.gather(1, n_acc), src[:, cols.drafts]], dim=1))
    b.positions[: m * q].view(m, q).copy_(pos)
    b.slot_mapping[: m * q].view(m, q).copy_(b.block_tables[:m].gather(1, pos // bs) * bs + pos % bs)
    b.seq_lens[:m].copy_(start[:, 0] + q)
    up = torch.cat([torch.zeros_like(start), parents], dim=1)  # each node's parent, the root its own
    node = t.nodes.expand(m, q)
    seen = t.mask[:m]
    seen.zero_()
    seen.scatter_(2, node[:, :, None], 1)
    for _ in range(cols.depth):  # a node of depth d reaches the root in d steps, then stays there
        node = up.gather(1, node)
        seen.scatter_(2, node[:, :, None], 1)
    t.depth[:m].copy_(seen.sum(dim=-1) - 1)
    t.parents[:m, 1:].copy_(parents)
