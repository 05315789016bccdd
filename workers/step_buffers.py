"""Fixed-address inputs of a uniform generation step: B sequences x Q rows (decode Q=1, verify Q=K+1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from mtpserve.speculative.messages import SeqPlan
from mtpserve.speculative.sampling import keyed_thresholds
from mtpserve.speculative.verify import ForcedAcceptance
from mtpserve.workers.config import MAX_STEPS_AHEAD

HOST_TWINS = MAX_STEPS_AHEAD + 1  # a step's host copy is refilled only once the step is read


@dataclass
class StepBuffers:
    """Device tensors allocated once; each step fills a host staging copy and sends it in one transfer.

    Every field is a view of one packed device tensor (and its pinned host twins), laid out as
    [input_ids | positions | slot_mapping | seq_lens | block_tables], so a step is one host-to-device copy
    of the prefix that the step uses. Steps rotate over HOST_TWINS host twins, so a step can be filled
    while the copies of the steps launched before it may still wait behind the GPU.
    """

    packed: torch.Tensor  # device int64, every field below is a view of it
    stagings: tuple[torch.Tensor, ...]  # host int64 twins of `packed` (pinned on CUDA)
    input_ids: torch.Tensor  # [B_max*Q] int64
    positions: torch.Tensor  # [B_max*Q] int64
    slot_mapping: torch.Tensor  # [B_max*Q] int64
    seq_lens: torch.Tensor  # [B_max] int64, KV length after the step
    block_tables: torch.Tensor  # [B_max, M] int64
    fpacked: torch.Tensor  # device float32: the sampling fields below are views of it
    fstagings: tuple[torch.Tensor, ...]  # host float32 twins of `fpacked`
    temperature: torch.Tensor  # [B_max] float32 (0 = greedy)
    top_k: torch.Tensor  # [B_max] float32 holding integers (0 = off)
    top_p: torch.Tensor  # [B_max] float32
    keys: torch.Tensor  # [B_max] int32 (a view of float32 storage): each request's sampling key
    q_len: int
    block_size: int
    scratch_block: int
    turn: int = 0  # which host twin the current step uses
    _pads: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # all-padding prefix by bucket

    @classmethod
    def allocate(
        cls, max_batch: int, q_len: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device
    ) -> StepBuffers:
        """Allocate for up to `max_batch` sequences of `max_blocks` blocks."""
        rows = max_batch * q_len
        sizes = [rows, rows, rows, max_batch, max_batch * max_blocks]
        packed = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        stagings = (torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pin) for _ in range(HOST_TWINS))
        ids, pos, slots, lens, tables = packed.split(sizes)
        fsizes = [max_batch, max_batch, max_batch, max_batch]
        fpacked = torch.zeros(sum(fsizes), dtype=torch.float32, device=device)
        fstagings = (torch.zeros(sum(fsizes), dtype=torch.float32, pin_memory=pin) for _ in range(HOST_TWINS))
        temp, top_k, top_p, keys = fpacked.split(fsizes)
        return cls(
            packed=packed,
            stagings=tuple(stagings),
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            seq_lens=lens,
            block_tables=tables.view(max_batch, max_blocks),
            fpacked=fpacked,
            fstagings=tuple(fstagings),
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            keys=keys.view(torch.int32),
            q_len=q_len,
            block_size=block_size,
            scratch_block=scratch_block,
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
        return [t.data_ptr() for t in (*ints, self.temperature, self.top_k, self.top_p, self.keys)]

    def sampling(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, thresholds [bucket, Q]) of the first `bucket` sequences: the thresholds of
        the positions their rows predict (`thresholds`)."""
        return self.temperature[:bucket], self.top_k[:bucket], self.top_p[:bucket], self.thresholds(bucket, self.q_len)

    def thresholds(self, bucket: int, n: int) -> torch.Tensor:
        """Keyed thresholds [bucket, n] of positions start+1..start+n, start being each sequence's first row's
        position (on the device, so steps whose inputs are advanced there get theirs too)."""
        start = self.positions[: bucket * self.q_len].view(bucket, self.q_len)[:, :1]
        offsets = torch.arange(1, n + 1, device=start.device)
        return keyed_thresholds(self.keys[:bucket, None], start + offsets)

    def fill_sampling(
        self,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        keys: list[int],
        bucket: int,
    ) -> None:
        """Copy n rows of sampling parameters and sampling keys; padding rows are greedy. Call after `fill`
        for the same step (it uses that step's host twin)."""
        n, b_max = len(temperature), self.max_batch
        if n > bucket or bucket > b_max or len(keys) != n:
            raise ValueError(f"sampling rows: {n} rows, {len(keys)} keys, bucket {bucket}")
        staging = self.fstagings[self.turn]
        host = staging.numpy()
        host[:bucket] = 0.0
        host[b_max : b_max + bucket] = 0.0
        host[2 * b_max : 2 * b_max + bucket] = 1.0
        key = host[3 * b_max :].view(np.int32)
        key[:bucket] = 0
        if n:
            host[:n] = temperature
            host[b_max : b_max + n] = top_k
            host[2 * b_max : 2 * b_max + n] = top_p
            key[:n] = keys
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
        q, n, m = self.q_len, len(token_ids), self.max_blocks
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} sequences do not fit bucket {bucket} (max {self.max_batch})")
        if len(tables) != n:
            raise ValueError(f"{n} sequences but {len(tables)} block tables")
        for b, t in enumerate(token_ids):
            if len(t) != q:
                raise ValueError(f"sequence {b} has {len(t)} rows, the step needs {q}")
        for b, t in enumerate(tables):
            if len(t) > m:
                raise ValueError(f"sequence {b} has {len(t)} blocks, buffers hold {m}")
        self.turn = (self.turn + 1) % HOST_TWINS
        staging = self.stagings[self.turn]
        host = staging.numpy()
        pad = self._padding(bucket)
        host[: pad.shape[0]] = pad
        table = self._regions(host)[-1]
        table[n:bucket, : -(-q // self.block_size)] = self.scratch_block  # what padding rows read
        if n == 1 and q == 1 and valid_rows is None:
            self._fill_one(host, token_ids[0][0], starts[0], tables[0])
        elif n:
            self._fill_many(host, token_ids, starts, tables, valid_rows=valid_rows)
        used = pad.shape[0] + bucket * m
        self.packed[:used].copy_(staging[:used], non_blocking=True)

    def _regions(self, host: np.ndarray) -> tuple[np.ndarray, ...]:
        """(input_ids, positions, slot_mapping, seq_lens, block_tables) views of a host twin."""
        r, b = self.max_batch * self.q_len, self.max_batch
        table = host[3 * r + b :].reshape(b, self.max_blocks)
        return host[:r], host[r : 2 * r], host[2 * r : 3 * r], host[3 * r : 3 * r + b], table

    def _padding(self, bucket: int) -> np.ndarray:
        """A host twin's tokens, positions, slots and lengths for `bucket` sequences that are all padding (scratch
        block rows). The block tables are not reset: a row is read only up to its length, so past a request's
        blocks its entries may be stale (valid block ids either way)."""
        pad = self._pads.get(bucket)
        if pad is None:
            q, bs, r, b = self.q_len, self.block_size, self.max_batch * self.q_len, self.max_batch
            pad = np.zeros(3 * r + b, dtype=np.int64)
            offsets = np.tile(np.arange(q), bucket)
            pad[r : r + bucket * q] = offsets
            pad[2 * r : 2 * r + bucket * q] = self.scratch_block * bs + offsets % bs
            pad[3 * r : 3 * r + bucket] = q
            self._pads[bucket] = pad
        return pad

    def _fill_one(self, host: np.ndarray, token: int, start: int, blocks: list[int]) -> None:
        """One decode row (Q = 1): the common batch-1 step, without array temporaries."""
        ids, pos, slots, lens, table = self._regions(host)
        bs = self.block_size
        table[0, : len(blocks)] = blocks
        ids[0] = token
        pos[0] = start
        slots[0] = table[0, start // bs] * bs + start % bs
        lens[0] = start + 1

    def _fill_many(
        self,
        host: np.ndarray,
        token_ids: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        valid_rows: list[int] | None,
    ) -> None:
        ids, pos, slots, lens, table = self._regions(host)
        q, bs, n = self.q_len, self.block_size, len(token_ids)
        real = n * q
        counts = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        blocks = np.fromiter(chain.from_iterable(tables), np.int64)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)  # each entry's request's first entry in `blocks`
        table[np.repeat(np.arange(n), counts), np.arange(blocks.size) - firsts] = blocks
        ids[:real] = np.fromiter(chain.from_iterable(token_ids), np.int64, count=real)
        start = np.fromiter(starts, np.int64, count=n)
        p = start[:, None] + np.arange(q)[None, :]  # [n, Q]
        pos[:real] = p.reshape(-1)
        real_slots = table[np.arange(n)[:, None], p // bs] * bs + p % bs
        if valid_rows is not None:
            inside = np.arange(q)[None, :] >= np.asarray(valid_rows)[:, None]
            real_slots = np.where(inside, self.scratch_block * bs + np.arange(q)[None, :] % bs, real_slots)
        slots[:real] = real_slots.reshape(-1)
        lens[:n] = start + q


class ForcedRows:
    """Fixed-address forced acceptance rows [B_max, Q] of a replayed step (`speculative/replay.py`): the
    host fills them per step with the step's other inputs (one copy from one of HOST_TWINS rotating host
    twins), the captured verify reads them in place of its comparison."""

    def __init__(self, replay: ForcedAcceptance, max_batch: int, q_len: int, device: torch.device) -> None:
        self.replay = replay
        self.rows_device = torch.zeros(max_batch, q_len, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._twins = tuple(torch.zeros(max_batch, q_len, dtype=torch.long, pin_memory=pin) for _ in range(HOST_TWINS))
        self._turn = 0

    def fill(self, seqs: Sequence[SeqPlan], bucket: int) -> None:
        """The replay's rows for a step's sequences; padding rows (up to `bucket`) accept nothing."""
        self._turn = (self._turn + 1) % HOST_TWINS
        host = self._twins[self._turn]
        n = len(seqs)
        host[:bucket] = 0
        if n:
            host[:n] = torch.from_numpy(self.replay.take(seqs, host.shape[1]))
        self.rows_device[:bucket].copy_(host[:bucket], non_blocking=True)

    def rows(self, bucket: int) -> torch.Tensor:
        """The device rows of the first `bucket` sequences."""
        return self.rows_device[:bucket]
