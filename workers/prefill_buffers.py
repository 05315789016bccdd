"""The fixed-address inputs of the captured prefill step: a step's prompt chunks, back to back, in slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mtpserve.speculative.messages import SeqPlan
from mtpserve.speculative.sampling import keyed_thresholds

PREFILL_SLOTS = 16  # prompt chunks one replay of the prefill step takes


@dataclass
class PrefillBuffers:
    """Fixed-address inputs of up to S chunks, every integer field a view of one device tensor filled by one
    copy: [ids T | positions T | slots T | block table S*W | chain table S*W | q start S | q len S | seq len S |
    real rows S | last row S | slot S]. Unused slots have no rows and repeat the last chunk's last row, chain
    table, sampling settings and slot index (their lookahead entry is the last chunk's)."""

    packed: torch.Tensor
    staging: torch.Tensor  # its host twin (pinned on CUDA)
    input_ids: torch.Tensor  # [T_max]
    positions: torch.Tensor  # [T_max] (padding rows: 0)
    slot_mapping: torch.Tensor  # [T_max] (padding rows: the scratch block)
    block_table: torch.Tensor  # [S, W] (past a request's blocks: the scratch block)
    chain_table: torch.Tensor  # [S, W] final chunks' tables; the scratch block for the others' drafts
    q_start: torch.Tensor  # [S] each chunk's first row
    q_len: torch.Tensor  # [S] rows: the last chunk's padded to the bucket, 0 for unused slots
    seq_len: torch.Tensor  # [S] start + q_len (0 for unused slots)
    real_len: torch.Tensor  # [S] each chunk's rows without padding (0 for unused slots)
    last_row: torch.Tensor  # [S] each chunk's last real row
    source: torch.Tensor  # [S] the chunk a slot stands for: itself, or the last chunk for unused slots
    fpacked: torch.Tensor  # device float32 [S, temperature | top-k | top-p | key (int32 bits)]
    fstaging: torch.Tensor  # its host twin
    block_size: int
    scratch_block: int
    max_blocks: int  # blocks a request may hold
    twins: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, fstaging), in turn
    twin: int = 0  # the pair `staging` and `fstaging` are now

    def rotate(self) -> int:
        """Fill the next pair of host twins from now on (replays queued back to back each read their own);
        returns its index."""
        self.twin = (self.twin + 1) % len(self.twins)
        self.staging, self.fstaging = self.twins[self.twin]
        return self.twin

    @classmethod
    def allocate(
        cls, max_tokens: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device, twins: int = 1
    ) -> PrefillBuffers:
        """Buffers for steps of up to `max_tokens` rows and requests of up to `max_blocks` blocks, with `twins`
        pairs of host twins."""
        slots, width = PREFILL_SLOTS, max_blocks + -(-max_tokens // block_size) + 1
        sizes = [max_tokens] * 3 + [slots * width] * 2 + [slots] * 6
        packed = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        pairs = [
            (
                torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pin),
                torch.zeros((slots, 4), dtype=torch.float32, pin_memory=pin),
            )
            for _ in range(twins)
        ]
        staging, fstaging = pairs[0]
        ids, pos, slot_map, table, chain, q_start, q_len, seq_len, real_len, last, source = packed.split(sizes)
        fpacked = torch.zeros((slots, 4), dtype=torch.float32, device=device)
        return cls(
            packed=packed, staging=staging, input_ids=ids, positions=pos, slot_mapping=slot_map,
            block_table=table.view(slots, width), chain_table=chain.view(slots, width), q_start=q_start,
            q_len=q_len, seq_len=seq_len, real_len=real_len, last_row=last, source=source, fpacked=fpacked,
            fstaging=fstaging, block_size=block_size, scratch_block=scratch_block, max_blocks=max_blocks,
            twins=pairs,
        )  # fmt: skip

    def sampling(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, threshold), one row per slot: the threshold of the position each chunk's
        last row predicts, from its request's key."""
        t, k, p, key = self.fpacked.unbind(1)
        positions = self.positions.index_select(0, self.last_row) + 1
        return t, k, p, keyed_thresholds(key.contiguous().view(torch.int32), positions)

    @property
    def max_tokens(self) -> int:
        """Rows a step may have."""
        return self.input_ids.shape[0]

    @property
    def slots(self) -> int:
        """Chunks a step may have."""
        return self.q_start.shape[0]

    def fits(self, seqs: list[SeqPlan]) -> bool:
        """Whether the chunks fit the slots, the rows and every request's block table."""
        rows = sum(len(s.token_ids) for s in seqs)
        return (
            0 < len(seqs) <= self.slots
            and rows <= self.max_tokens
            and all(len(s.block_ids) <= self.max_blocks for s in seqs)
        )

    def fill(self, seqs: list[SeqPlan], bucket: int) -> None:
        """Copy the chunks into rows [0, n) back to back and pad rows [n, bucket) onto the last chunk."""
        n = sum(len(s.token_ids) for s in seqs)
        if not self.fits(seqs) or not 0 < n <= bucket <= self.max_tokens:
            raise ValueError(f"{len(seqs)} chunks of {n} rows do not fit bucket {bucket}")
        t_max, bs, slots = self.max_tokens, self.block_size, self.slots
        width = self.block_table.shape[1]
        host = self.staging.numpy()
        ids, pos, slot_map = host[:t_max], host[t_max : 2 * t_max], host[2 * t_max : 3 * t_max]
        tables = host[3 * t_max : 3 * t_max + 2 * slots * width].reshape(2, slots, width)
        q_start, q_len, seq_len, real_len, last, source = host[3 * t_max + 2 * slots * width :].reshape(6, slots)
        tables[:] = self.scratch_block
        rows = np.arange(bucket)
        ids[:bucket], pos[:bucket] = 0, 0  # padding rows' RoPE angle; they attend by row, not by position
        slot_map[:bucket] = self.scratch_block * bs + rows % bs
        q_start[:], q_len[:], seq_len[:], real_len[:] = n, 0, 0, 0
        offset = 0
        for j, s in enumerate(seqs):
            m = len(s.token_ids)
            tables[0, j, : len(s.block_ids)] = s.block_ids
            if s.is_final_chunk:
                tables[1, j] = tables[0, j]
            real = np.arange(m) + s.start
            ids[offset : offset + m] = s.token_ids
            pos[offset : offset + m] = real
            slot_map[offset : offset + m] = tables[0, j, real // bs] * bs + real % bs
            rows_j = m if j < len(seqs) - 1 else bucket - offset
            q_start[j], q_len[j], seq_len[j], real_len[j] = offset, rows_j, s.start + rows_j, m
            last[j], source[j] = offset + m - 1, j
            offset += m
        used = len(seqs)
        tables[1, used:] = tables[1, used - 1]
        last[used:], source[used:] = last[used - 1], used - 1
        self.packed.copy_(self.staging, non_blocking=True)

    def fill_sampling(self, seqs: list[SeqPlan], keys: list[int]) -> None:
        """Copy each final chunk's temperature, top-k, top-p and sampling key (non-final chunks: greedy)."""
        host = self.fstaging.numpy()
        host[:] = 0
        for j, (s, key) in enumerate(zip(seqs, keys, strict=True)):
            if s.is_final_chunk:
                host[j, :3] = (s.temperature, s.top_k, s.top_p)
                host[j, 3:].view(np.int32)[0] = key
        host[len(seqs) :] = host[len(seqs) - 1]
        self.fpacked.copy_(self.fstaging, non_blocking=True)
