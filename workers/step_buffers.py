"""Fixed-address inputs of a uniform generation step: B sequences x Q rows (decode Q=1, verify Q=K+1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBuffers:
    """Device tensors allocated once; each step copies its inputs in (shapes for B_max sequences)."""

    input_ids: torch.Tensor  # [B_max*Q] int64
    positions: torch.Tensor  # [B_max*Q] int64
    slot_mapping: torch.Tensor  # [B_max*Q] int64
    block_tables: torch.Tensor  # [B_max, M] int64
    seq_lens: torch.Tensor  # [B_max] int64, KV length after the step
    q_len: int
    block_size: int
    scratch_block: int

    @classmethod
    def allocate(
        cls, max_batch: int, q_len: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device
    ) -> StepBuffers:
        """Allocate for up to `max_batch` sequences of `max_blocks` blocks."""
        rows = max_batch * q_len

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(z(rows), z(rows), z(rows), z(max_batch, max_blocks), z(max_batch), q_len, block_size, scratch_block)

    @property
    def max_batch(self) -> int:
        """Sequences the buffers hold."""
        return self.seq_lens.shape[0]

    @property
    def max_blocks(self) -> int:
        """Blocks per sequence the buffers hold."""
        return self.block_tables.shape[1]

    def addresses(self) -> list[int]:
        """data_ptr of every buffer (must never change)."""
        return [
            t.data_ptr() for t in (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.seq_lens)
        ]

    def fill(self, token_ids: list[list[int]], starts: list[int], tables: list[list[int]], bucket: int) -> None:
        """Copy n real sequences into rows [0, bucket*Q) and pad the rest onto the scratch block."""
        q, bs, n = self.q_len, self.block_size, len(token_ids)
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} sequences do not fit bucket {bucket} (max {self.max_batch})")
        ids = torch.zeros(bucket * q, dtype=torch.long)
        pos = torch.arange(q).repeat(bucket)
        slots = self.scratch_block * bs + torch.arange(q).repeat(bucket) % bs
        table = torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.long)
        lens = torch.full((bucket,), q, dtype=torch.long)
        for b, (toks, start, blocks) in enumerate(zip(token_ids, starts, tables, strict=True)):
            if len(toks) != q:
                raise ValueError(f"sequence {b} has {len(toks)} rows, the step needs {q}")
            if len(blocks) > self.max_blocks:
                raise ValueError(f"sequence {b} has {len(blocks)} blocks, buffers hold {self.max_blocks}")
            p = torch.arange(start, start + q)
            bt = torch.tensor(blocks, dtype=torch.long)
            ids[b * q : (b + 1) * q] = torch.tensor(toks)
            pos[b * q : (b + 1) * q] = p
            slots[b * q : (b + 1) * q] = bt[p // bs] * bs + p % bs
            table[b, : len(blocks)] = bt
            lens[b] = start + q
        rows = bucket * q
        self.input_ids[:rows].copy_(ids, non_blocking=True)
        self.positions[:rows].copy_(pos, non_blocking=True)
        self.slot_mapping[:rows].copy_(slots, non_blocking=True)
        self.block_tables[:bucket].copy_(table, non_blocking=True)
        self.seq_lens[:bucket].copy_(lens, non_blocking=True)
