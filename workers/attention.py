"""Paged attention over a flattened batch that mixes context chunks and decode/verify rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step index tensors shared by every layer (shapes in comments; T = scheduled tokens, B = seqs)."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot written by each token
    q_index: torch.Tensor  # [B, Q] int64, row of each padded query (pad rows point at 0)
    q_valid: torch.Tensor  # [B, Q] bool
    kv_slots: torch.Tensor  # [B, S] int64, cache slot of each key position (pad -> 0)
    mask: torch.Tensor  # [B, 1, Q, S] bool, True where the query may attend
    out_index: torch.Tensor  # [T] int64, flat index into [B*Q] for each scheduled token

    @classmethod
    def build(
        cls,
        seq_starts: list[int],
        seq_num_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata for sequences whose new tokens occupy positions [start, start + n)."""
        bsz = len(seq_starts)
        q_max = max(seq_num_tokens)
        s_max = max(s + n for s, n in zip(seq_starts, seq_num_tokens, strict=True))
        q_index = torch.zeros(bsz, q_max, dtype=torch.long)
        q_valid = torch.zeros(bsz, q_max, dtype=torch.bool)
        q_pos = torch.zeros(bsz, q_max, dtype=torch.long)
        kv_slots = torch.zeros(bsz, s_max, dtype=torch.long)
        seq_len = torch.zeros(bsz, dtype=torch.long)
        slot_rows, out_rows = [], []
        row = 0
        for b, (start, n, table) in enumerate(zip(seq_starts, seq_num_tokens, block_tables, strict=True)):
            end = start + n
            if (end + block_size - 1) // block_size > len(table):
                raise ValueError(f"sequence {b} needs {end} slots but has {len(table)} blocks")
            pos = torch.arange(end)
            blocks = torch.tensor(table, dtype=torch.long)
            slots = blocks[pos // block_size] * block_size + pos % block_size
            kv_slots[b, :end] = slots
            q_index[b, :n] = torch.arange(row, row + n)
            q_valid[b, :n] = True
            q_pos[b, :n] = torch.arange(start, end)
            seq_len[b] = end
            slot_rows.append(slots[start:end])
            out_rows.append(torch.arange(n) + b * q_max)
            row += n
        key_pos = torch.arange(s_max)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_len[:, None, None])
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # pad rows attend to one key so softmax stays finite
        return cls(
            slot_mapping=torch.cat(slot_rows).to(device),
            q_index=q_index.to(device),
            q_valid=q_valid.to(device),
            kv_slots=kv_slots.to(device),
            mask=mask[:, None].to(device),
            out_index=torch.cat(out_rows).to(device),
        )


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
    """Causal attention of q [T, H, D] against cached keys/values; returns [T, H*D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    qp = q[meta.q_index].transpose(1, 2)  # [B, H, Q, D]
    kp = flat_k[meta.kv_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    vp = flat_v[meta.kv_slots].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [B*Q, H*D]
    return out[meta.out_index]
