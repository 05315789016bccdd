"""Paged attention: a ragged path for batches mixing context chunks and decode rows, and a
static-shape path for uniform generation steps (fixed buffers, safe to capture in a CUDA graph)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtpserve.modeling import triton_attention

SCORE_ELEMENTS = 1 << 26  # fp32 attention scores one pass of one-KV-head attention may hold (256 MB)


class Metadata(Protocol):
    """What a layer needs: where to write this step's K/V, and how to attend."""

    slot_mapping: torch.Tensor

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the cache; returns [T, H*D]."""
        ...

    def attend_sdpa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` through torch SDPA on any device, where values may be narrower than keys (latent
        attention); returns [T, H*Dv]."""
        ...


@dataclass
class PaddedGroup:
    """Sequences of one step with the same number of new rows q, keys padded to the longest (s)."""

    q_index: torch.Tensor  # [b, q] int64, the step row of each query
    kv_slots: torch.Tensor  # [b, s] int64, cache slot of each key position (pad -> 0)
    mask: torch.Tensor  # [b, 1, q, s] bool, True where the query may attend
    rows: torch.Tensor  # [b*q] int64, q_index flattened: where the group's outputs go


@dataclass
class AttentionMetadata:
    """Index tensors of a ragged step, shared by every layer (T = scheduled tokens). Sequences are padded
    in groups of equal row counts (all decode rows together, each verify width, each prompt chunk), so a
    long chunk does not pad every decode row to its length."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot written by each token
    groups: list[PaddedGroup]

    @classmethod
    def build(
        cls,
        seq_starts: list[int],
        seq_num_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        row_masks: list[torch.Tensor | None] | None = None,
    ) -> AttentionMetadata:
        """Build metadata for sequences whose new tokens occupy positions [start, start + n).

        Attention is causal, unless `row_masks[b]` is given: a bool [n, m] mask (m >= n) saying which of
        the sequence's last m key positions [start + n - m, start + n) each new row sees, as draft trees
        need; the keys before those stay visible to every row."""
        starts = np.asarray(seq_starts, dtype=np.int64)
        counts = np.asarray(seq_num_tokens, dtype=np.int64)
        ends = starts + counts
        table = np.zeros((len(starts), max(len(t) for t in block_tables)), dtype=np.int64)
        for b, (t, end) in enumerate(zip(block_tables, ends, strict=True)):
            if (end + block_size - 1) // block_size > len(t):
                raise ValueError(f"sequence {b} needs {end} slots but has {len(t)} blocks")
            table[b, : len(t)] = t
        masks = row_masks or [None] * len(starts)
        for b, rm in enumerate(masks):
            n, end = int(counts[b]), int(ends[b])
            if rm is not None and (rm.shape[0] != n or not n <= rm.shape[1] <= end):
                raise ValueError(f"row mask of sequence {b} is {tuple(rm.shape)}; needs [{n}, m], {n} <= m <= {end}")
        row0 = np.cumsum(counts) - counts
        slots = np.empty(int(counts.sum()), dtype=np.int64)
        groups = []
        for n in np.unique(counts):
            members = np.flatnonzero(counts == n)
            group, group_slots = _padded_group(
                starts[members],
                int(n),
                table[members],
                block_size,
                masks=[masks[i] for i in members],
                row0=row0[members],
            )
            slots[group.rows.numpy()] = group_slots
            groups.append(_to_device(group, device))
        return cls(torch.from_numpy(slots).to(device), groups)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Ragged paged attention (see `paged_attention`)."""
        return paged_attention(q, k_cache, v_cache, self, scale=scale)

    attend_sdpa = attend


def _padded_group(
    starts: np.ndarray,
    n: int,
    table: np.ndarray,
    block_size: int,
    masks: list[torch.Tensor | None],
    row0: np.ndarray,
) -> tuple[PaddedGroup, np.ndarray]:
    """(the group of sequences with `n` new rows each, starting at step rows `row0`; the slot of each row)."""
    ends = starts + n
    key_pos = np.arange(int(ends.max()))
    in_seq = key_pos[None, :] < ends[:, None]  # [b, s]
    blocks = table[:, np.minimum(key_pos // block_size, table.shape[1] - 1)]
    kv_slots = np.where(in_seq, blocks * block_size + key_pos % block_size, 0)
    q_pos = starts[:, None] + np.arange(n)[None, :]  # [b, q]
    rows = row0[:, None] + np.arange(n)[None, :]
    mask = torch.from_numpy((key_pos[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :])
    for b, rm in enumerate(masks):
        if rm is not None:
            end = int(ends[b])
            mask[b, :, end - rm.shape[1] : end] &= rm.to(torch.bool)
    group = PaddedGroup(
        q_index=torch.from_numpy(rows),
        kv_slots=torch.from_numpy(kv_slots),
        mask=mask[:, None],
        rows=torch.from_numpy(rows.reshape(-1)),
    )
    return group, np.take_along_axis(kv_slots, q_pos, axis=1).reshape(-1)


def _to_device(group: PaddedGroup, device: torch.device | str) -> PaddedGroup:
    return PaddedGroup(
        group.q_index.to(device), group.kv_slots.to(device), group.mask.to(device), group.rows.to(device)
    )


@dataclass
class RaggedMetadata:
    """A ragged step for the Triton kernel: per-sequence row offsets and lengths instead of a dense mask
    (no padding of short rows up to the longest chunk)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, M] int64 (padded with 0; never read past a sequence's length)
    q_starts: torch.Tensor  # [B] int64, first row of each sequence in the flat batch
    q_lens: torch.Tensor  # [B] int64, rows (new positions) of each sequence
    seq_lens: torch.Tensor  # [B] int64, KV length after the step
    max_q_len: int
    host_rows: list[tuple[int, int, int]] | None = None  # (q_start, q_len, seq_len) per sequence, read once
    row_masks: list[torch.Tensor | None] | None = None  # [B] draft trees' masks, as `AttentionMetadata.build`
    tree_bits: torch.Tensor | None = None  # [T] int64 the same masks as the kernel reads them (-1: causal)
    tree_width: int = 0  # keys the masks cover, the last of each sequence

    @classmethod
    def build(
        cls,
        seq_starts: list[int],
        seq_num_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        row_masks: list[torch.Tensor | None] | None = None,
    ) -> RaggedMetadata:
        """Metadata for sequences whose new tokens occupy positions [start, start + n); `row_masks` as in
        `AttentionMetadata.build`, all of one width (at most 64 keys)."""
        starts = np.asarray(seq_starts, dtype=np.int64)
        counts = np.asarray(seq_num_tokens, dtype=np.int64)
        ends = starts + counts
        width = max(len(t) for t in block_tables)
        table = np.zeros((len(block_tables), width), dtype=np.int64)
        for b, (t, end) in enumerate(zip(block_tables, ends, strict=True)):
            if (end + block_size - 1) // block_size > len(t):
                raise ValueError(f"sequence {b} needs {end} slots but has {len(t)} blocks")
            table[b, : len(t)] = t
        owner = np.repeat(np.arange(len(counts)), counts)
        pos = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        slots = table[owner, pos // block_size] * block_size + pos % block_size
        q_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        packed = torch.from_numpy(np.concatenate([slots, q_starts, counts, ends, table.reshape(-1)])).to(device)
        n, b = len(slots), len(counts)
        s, qs, ql, sl, tb = packed.split([n, b, b, b, table.size])
        meta = cls(s, tb.view(b, width), q_starts=qs, q_lens=ql, seq_lens=sl, max_q_len=int(counts.max()))
        if row_masks is not None and any(m is not None for m in row_masks):
            meta.row_masks = row_masks
            meta.tree_width, bits = _tree_bits(row_masks, seq_num_tokens)
            meta.tree_bits = bits.to(device)
        return meta

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Ragged paged attention (Triton; CUDA, or CPU under TRITON_INTERPRET)."""
        return triton_attention.triton_ragged_attention(
            q, k_cache, v_cache, self.block_tables, q_starts=self.q_starts, q_lens=self.q_lens, seq_lens=self.seq_lens,
            max_q_len=self.max_q_len, scale=scale,
            tree_bits=self.tree_bits, tree_width=self.tree_width,
        )  # fmt: skip

    def attend_sdpa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The same attention through masked SDPA, one sequence at a time (eager steps only: reads lengths)."""
        block_size = k_cache.shape[1]
        if self.host_rows is None:  # once per step, not once per layer
            self.host_rows = list(
                zip(self.q_starts.tolist(), self.q_lens.tolist(), self.seq_lens.tolist(), strict=True)
            )
        outs = []
        masks = self.row_masks or [None] * len(self.host_rows)
        for (start, n, end), table, rm in zip(self.host_rows, self.block_tables, masks, strict=True):
            if n == 0:
                continue  # an unused slot of a fixed-shape step
            width = -(-end // block_size)
            tree = None if rm is None else rm[None].to(q.device)
            lens = self.seq_lens.new_tensor([end])
            out = uniform_paged_attention(
                q[start : start + n],
                k_cache,
                v_cache,
                table[None, :width],
                seq_lens=lens,
                q_len=n,
                scale=scale,
                tree_mask=tree,
            )
            outs.append(out)
        return torch.cat(outs)


def _tree_bits(row_masks: list[torch.Tensor | None], counts: list[int]) -> tuple[int, torch.Tensor]:
    """(the masks' common width, one int64 of visibility bits per row [T], -1 for rows without a mask)."""
    widths = {m.shape[1] for m in row_masks if m is not None}
    if len(widths) != 1 or max(widths) > triton_attention.TREE_BITS:
        raise ValueError(f"row masks of one step need one width of at most 64 keys, got {sorted(widths)}")
    width = widths.pop()
    rows = [
        torch.full((n,), -1, dtype=torch.long) if m is None else triton_attention.tree_mask_bits(m.bool()[None])
        for m, n in zip(row_masks, counts, strict=True)
    ]
    return width, torch.cat(rows)


def ragged_metadata(
    seq_starts: list[int],
    seq_num_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    row_masks: list[torch.Tensor | None] | None = None,
) -> Metadata:
    """Metadata for a ragged step: the Triton kernel's on CUDA, the masked-SDPA path elsewhere (`row_masks`:
    draft trees, see `AttentionMetadata.build`)."""
    if torch.device(device).type == "cuda" and triton_attention.available():
        return RaggedMetadata.build(
            seq_starts, seq_num_tokens, block_tables, block_size=block_size, device=device, row_masks=row_masks
        )
    return AttentionMetadata.build(
        seq_starts, seq_num_tokens, block_tables, block_size=block_size, device=device, row_masks=row_masks
    )


@dataclass
class UniformMetadata:
    """A generation step where each of B sequences has exactly Q new rows (decode Q=1, verify Q=K+1).

    Every tensor has a fixed shape, so the step can be captured once per batch size and replayed.
    """

    slot_mapping: torch.Tensor  # [B*Q] int64 (padding rows write a scratch slot)
    block_tables: torch.Tensor  # [B, M] int64, M = max blocks per sequence
    seq_lens: torch.Tensor  # [B] int64, KV length after this step (padding: Q)
    q_len: int  # Q
    tree_mask: torch.Tensor | None = None  # [B, Q, W] bool, W >= Q: which of the last W keys each row sees
    # (draft trees; the keys before them stay visible); None: causal
    _tree_bits: torch.Tensor | None = field(default=None, repr=False)  # the mask as the Triton kernel reads it

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the last Q positions of each sequence over its blocks; returns [B*Q, H*D]."""
        tree = self.tree_mask
        if q.is_cuda and triton_attention.available():
            if tree is None:
                return triton_attention.triton_uniform_attention(
                    q, k_cache, v_cache, self.block_tables, seq_lens=self.seq_lens, q_len=self.q_len, scale=scale
                )
            if tree.shape[-1] <= triton_attention.TREE_BITS:
                if self._tree_bits is None:  # once per step, not once per layer
                    self._tree_bits = triton_attention.tree_mask_bits(tree)
                return triton_attention.triton_uniform_attention(
                    q,
                    k_cache,
                    v_cache,
                    self.block_tables,
                    seq_lens=self.seq_lens,
                    q_len=self.q_len,
                    scale=scale,
                    tree_bits=self._tree_bits,
                    tree_width=tree.shape[-1],
                )
        return self.attend_sdpa(q, k_cache, v_cache, scale)

    def attend_sdpa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The reference static-shape path on any device (safe to capture)."""
        return uniform_paged_attention(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            seq_lens=self.seq_lens,
            q_len=self.q_len,
            scale=scale,
            tree_mask=self.tree_mask,
        )


def uniform_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    *,
    scale: float,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference static-shape kernel: gather every block of the table, mask by position (and, with
    `tree_mask` [B, Q, W], by row over each sequence's last W keys). q [B*Q, H, D]."""
    bsz, max_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    heads, v_dim = q.shape[1], v_cache.shape[-1]
    keys = k_cache[block_tables].reshape(bsz, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    vals = v_cache[block_tables].reshape(bsz, max_blocks * block_size, kv_heads, v_dim).transpose(1, 2)
    qp = q.view(bsz, q_len, heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(max_blocks * block_size, device=q.device)
    q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)[None, :]  # [B, Q]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    if tree_mask is not None:
        width = tree_mask.shape[-1]
        rel = key_pos[None, None, :] - (seq_lens[:, None, None] - width)  # [B, 1, S] index into the last W keys
        inside = (rel >= 0) & (rel < width)
        picked = tree_mask.gather(2, rel.clamp(0, width - 1).expand(bsz, q_len, -1))
        mask &= ~inside | picked
    out = masked_sdpa(qp, keys.to(q.dtype), vals.to(q.dtype), mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(bsz * q_len, heads * v_dim)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with a boolean mask and GQA. On CUDA the cuDNN backend is skipped: profiling showed it
    spending ~2 ms of host time per call building plans for masked inputs."""
    if k.shape[1] == 1 and q.shape[1] > 1:
        return one_kv_head_attention(q, k, v, mask, scale=scale)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def one_kv_head_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of H query heads over one shared key/value head (MQA, and MLA's latent rows) as two batched
    matrix products over all heads at once: q [B, H, Q, D], k [B, 1, S, D], v [B, 1, S, Dv], mask
    broadcastable to [B, H, Q, S]; returns [B, H, Q, Dv]. SDPA would first copy the keys to every head. Long
    queries go in slices of rows, so the fp32 scores stay under SCORE_ELEMENTS."""
    b, h, qn, d = q.shape
    rows = max(1, SCORE_ELEMENTS // (b * h * k.shape[2]))  # query rows per pass: bounded score memory
    if qn > rows:
        parts = [
            one_kv_head_attention(q[:, :, i : i + rows], k, v, mask[..., i : i + rows, :], scale=scale)
            for i in range(0, qn, rows)
        ]
        return torch.cat(parts, dim=2)
    scores = torch.matmul(q.reshape(b, 1, h * qn, d), k.transpose(-1, -2)).float().view(b, h, qn, -1) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs.view(b, 1, h * qn, -1), v).view(b, h, qn, v.shape[-1])


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, value: torch.Tensor) -> None:
    """Store `value` [T, H, D] into the paged `cache` [blocks, block_size, H, D] at the given slots."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, value.to(cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] against cached keys/values, one padded group at a time; returns
    [T, H*Dv]."""
    num_heads, v_dim = q.shape[1], v_cache.shape[-1]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = q.new_empty(q.shape[0], num_heads * v_dim)
    for g in meta.groups:
        qp = q[g.q_index].transpose(1, 2)  # [b, H, q, D]
        kp = flat_k[g.kv_slots].transpose(1, 2).to(q.dtype)  # [b, Hkv, s, D]
        vp = flat_v[g.kv_slots].transpose(1, 2).to(q.dtype)
        out[g.rows] = masked_sdpa(qp, kp, vp, g.mask, scale=scale).transpose(1, 2).reshape(-1, num_heads * v_dim)
    return out
