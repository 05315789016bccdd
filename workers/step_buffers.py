"""Fixed-address inputs of a uniform generation step: B sequences x Q rows (decode Q=1, verify Q=K+1)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


@dataclass
class StepBuffers:
    """Device tensors allocated once; each step fills a host staging copy and sends it in one transfer.

    Every field is a view of one packed device tensor (and its pinned host twins), laid out as
    [input_ids | positions | slot_mapping | seq_lens | block_tables], so a step is one host-to-device copy
    of the prefix that the step uses. Steps alternate between two host twins, so a step can be filled
    while the previous step's copy may still be queued behind the GPU.
    """

    packed: torch.Tensor  # device int64, every field below is a view of it
    stagings: tuple[torch.Tensor, torch.Tensor]  # host int64 twins of `packed` (pinned on CUDA)
    input_ids: torch.Tensor  # [B_max*Q] int64
    positions: torch.Tensor  # [B_max*Q] int64
    slot_mapping: torch.Tensor  # [B_max*Q] int64
    seq_lens: torch.Tensor  # [B_max] int64, KV length after the step
    block_tables: torch.Tensor  # [B_max, M] int64
    fpacked: torch.Tensor  # device float32: the sampling fields below are views of it
    fstagings: tuple[torch.Tensor, torch.Tensor]  # host float32 twins of `fpacked`
    temperature: torch.Tensor  # [B_max] float32 (0 = greedy)
    top_k: torch.Tensor  # [B_max] float32 holding integers (0 = off)
    top_p: torch.Tensor  # [B_max] float32
    uniforms: torch.Tensor  # [B_max, Q] float32, the verify step's random numbers
    q_len: int
    block_size: int
    scratch_block: int
    turn: int = 0  # which host twin the current step uses

    @classmethod
    def allocate(
        cls, max_batch: int, q_len: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device
    ) -> StepBuffers:
        """Allocate for up to `max_batch` sequences of `max_blocks` blocks."""
        rows = max_batch * q_len
        sizes = [rows, rows, rows, max_batch, max_batch * max_blocks]
        packed = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        stagings = (torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pin) for _ in range(2))
        ids, pos, slots, lens, tables = packed.split(sizes)
        fsizes = [max_batch, max_batch, max_batch, rows]
        fpacked = torch.zeros(sum(fsizes), dtype=torch.float32, device=device)
        fstagings = (torch.zeros(sum(fsizes), dtype=torch.float32, pin_memory=pin) for _ in range(2))
        temp, top_k, top_p, uniforms = fpacked.split(fsizes)
        return cls(
            packed,
            tuple(stagings),  # type: ignore[arg-type]
            ids,
            pos,
            slots,
            lens,
            tables.view(max_batch, max_blocks),
            fpacked,
            tuple(fstagings),  # type: ignore[arg-type]
            temp,
            top_k,
            top_p,
            uniforms.view(max_batch, q_len),
            q_len,
            block_size,
            scratch_block,
        )

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
        ints = (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.seq_lens)
        return [t.data_ptr() for t in (*ints, self.temperature, self.top_k, self.top_p, self.uniforms)]

    def sampling(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, uniforms) views of the first `bucket` sequences."""
        return self.temperature[:bucket], self.top_k[:bucket], self.top_p[:bucket], self.uniforms[:bucket]

    def fill_sampling(
        self,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        uniforms: torch.Tensor,
        bucket: int,
    ) -> None:
        """Copy n rows of sampling parameters and verify uniforms [n, Q]; padding rows are greedy. Call
        after `fill` for the same step (it uses that step's host twin)."""
        n, b_max, q = len(temperature), self.max_batch, self.q_len
        if n > bucket or bucket > b_max or tuple(uniforms.shape) != (n, q):
            raise ValueError(f"sampling rows: {n} rows, uniforms {tuple(uniforms.shape)}, bucket {bucket}, Q {q}")
        staging = self.fstagings[self.turn]
        host = staging.numpy()
        host[:bucket] = 0.0
        host[b_max : b_max + bucket] = 0.0
        host[2 * b_max : 2 * b_max + bucket] = 1.0
        u = host[3 * b_max :].reshape(b_max, q)
        u[:bucket] = 0.0
        if n:
            host[:n] = temperature
            host[b_max : b_max + n] = top_k
            host[2 * b_max : 2 * b_max + n] = top_p
            u[:n] = uniforms.numpy()
        self.fpacked.copy_(staging, non_blocking=True)

    def fill(
        self,
        token_ids: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        bucket: int,
        valid_rows: list[int] | None = None,
    ) -> None:
        """Copy n real sequences into rows [0, bucket*Q) and pad the rest onto the scratch block.
        With `valid_rows`, only a sequence's first valid_rows[b] rows write its own KV slots; the others
        (padding inside a sequence) write the scratch block."""
        q, bs, n = self.q_len, self.block_size, len(token_ids)
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} sequences do not fit bucket {bucket} (max {self.max_batch})")
        rows_max, m = self.max_batch * q, self.max_blocks
        self.turn ^= 1
        staging = self.stagings[self.turn]
        host = staging.numpy()
        ids = host[:rows_max]
        pos = host[rows_max : 2 * rows_max]
        slots = host[2 * rows_max : 3 * rows_max]
        lens = host[3 * rows_max : 3 * rows_max + self.max_batch]
        table = host[3 * rows_max + self.max_batch :].reshape(self.max_batch, m)
        rows, real = bucket * q, n * q
        offsets = np.tile(np.arange(q), bucket)
        ids[:rows] = 0
        pos[:rows] = offsets
        slots[:rows] = self.scratch_block * bs + offsets % bs
        lens[:bucket] = q
        table[:bucket] = self.scratch_block
        if len(tables) != n:
            raise ValueError(f"{n} sequences but {len(tables)} block tables")
        counts = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        if n and counts.max() > m:
            b = int(counts.argmax())
            raise ValueError(f"sequence {b} has {counts[b]} blocks, buffers hold {m}")
        if n:
            table[:n][np.arange(m)[None, :] < counts[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64)
            rows_in = np.fromiter(map(len, token_ids), dtype=np.int64, count=n)
            if (rows_in != q).any():
                b = int(np.flatnonzero(rows_in != q)[0])
                raise ValueError(f"sequence {b} has {rows_in[b]} rows, the step needs {q}")
            ids_in = np.asarray(token_ids, dtype=np.int64)
            start = np.asarray(starts, dtype=np.int64)
            p = start[:, None] + np.arange(q)[None, :]  # [n, Q]
            ids[:real] = ids_in.reshape(-1)
            pos[:real] = p.reshape(-1)
            real_slots = table[np.arange(n)[:, None], p // bs] * bs + p % bs
            if valid_rows is not None:
                pad = np.arange(q)[None, :] >= np.asarray(valid_rows)[:, None]
                real_slots = np.where(pad, self.scratch_block * bs + np.arange(q)[None, :] % bs, real_slots)
            slots[:real] = real_slots.reshape(-1)
            lens[:n] = start + q
        used = 3 * rows_max + self.max_batch + bucket * m
        self.packed[:used].copy_(staging[:used], non_blocking=True)
