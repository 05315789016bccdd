"""Triton paged attention on CUDA: uniform generation steps (decode, verify) and ragged batches
(prefill chunks mixed with generation rows).

Uniform: a program per (sequence, KV head, key range) handles the Q query rows of every query head in that
KV group, walking the sequence's block table with an online softmax, 128 keys (several cache blocks,
gathered through the table) per iteration. Small batches of long sequences cut each sequence's keys into
several ranges (split-KV decoding); the last program of a group to finish merges the partial results, so
one launch does it all. It reads only the blocks a sequence uses, and all its sizes are read on device, so
it can be captured in a CUDA graph. Launched with PDL (`modeling/pdl.py`), a program reads its first tile
of keys and values while the kernel ahead (which writes q and this step's K/V rows) still runs, and only
q and the step's own rows after it.
Ragged: the same walk, with a third program axis over tiles of QB query positions, each sequence's
query count and row offset read on device, and each tile stopping at its last position's causal limit.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mtpserve.modeling import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:
    from mtpserve.modeling.pdl import wait_for_inputs

    @triton.jit
    def _tile_addr(tables_ptr, b, kvh, kpos, inside, stride_kb, stride_ks, stride_kh, stride_bt, BLOCK: tl.constexpr):
        # cache offsets [TILE] of keys kpos of sequence b, KV head kvh, through its block table
        blk = tl.load(tables_ptr + b * stride_bt + kpos // BLOCK, mask=inside, other=0).to(tl.int64)
        return blk * stride_kb + (kpos % BLOCK) * stride_ks + kvh * stride_kh

    @triton.jit
    def _softmax_start(ROWS: tl.constexpr, DIM: tl.constexpr):
        # an online softmax before any key: (running max [ROWS], denominator [ROWS], accumulator [ROWS, DIM])
        return tl.full((ROWS,), -1.0e30, tl.float32), tl.zeros((ROWS,), tl.float32), tl.zeros((ROWS, DIM), tl.float32)

    @triton.jit
    def _attend_tile(q, k, v, kpos, q_pos, m, den, acc, scale, tree_bits, tree_start, TREE: tl.constexpr):
        # one online-softmax update of (m, den, acc) by the keys kpos [TILE] with values k, v [TILE, DIM].
        # TREE: key tree_start + j (0 <= j < 64) is seen by a row only where bit j of its tree_bits [ROWS] is set.
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        seen = kpos[None, :] <= q_pos[:, None]
        if TREE:
            rel = kpos - tree_start
            covered = (rel >= 0) & (rel < 64)
            bit = (tree_bits[:, None] >> tl.where(covered, rel, 0).to(tl.int64)[None, :]) & 1
            seen = seen & (~covered[None, :] | (bit != 0))
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, den, acc

    @triton.jit
    def _attend_range(
        q, k_ptr, v_ptr, tables_ptr, scale, stride_kb, stride_ks, stride_kh, stride_bt,
        b, kvh, q_pos, kv_start, kv_end, tree_bits, tree_start, m, den, acc,
        BLOCK: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, TREE: tl.constexpr,
    ):  # fmt: skip
        # online softmax of query rows q [ROWS, DIM] over keys [kv_start, kv_end) of sequence b (kv_start a
        # multiple of TILE), continuing from (m, den, acc); returns the unnormalised (acc [ROWS, DIM], running
        # max [ROWS], denominator [ROWS]).
        d = tl.arange(0, DIM)
        s = tl.arange(0, TILE)
        for j in tl.range(kv_start // TILE, tl.cdiv(kv_end, TILE), num_stages=STAGES):
            kpos = j * TILE + s
            inside = kpos < kv_end
            addr = _tile_addr(tables_ptr, b, kvh, kpos, inside, stride_kb, stride_ks, stride_kh, stride_bt, BLOCK)
            k = tl.load(k_ptr + addr[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + addr[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            m, den, acc = _attend_tile(q, k, v, kpos, q_pos, m, den, acc, scale, tree_bits, tree_start, TREE)
        return acc, m, den

    @triton.jit
    def _attend_rows(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_bt, b, kvh, row, head, valid, q_pos, kv_end, tree_bits, tree_start,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr,
        TREE: tl.constexpr,
    ):  # fmt: skip
        # attention of query rows (flat row, head) of sequence b over its first kv_end keys, stored to o
        d = tl.arange(0, DIM)
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=valid[:, None], other=0.0
        )
        m, den, acc = _softmax_start(ROWS, DIM)
        acc, _, den = _attend_range(q, k_ptr, v_ptr, tables_ptr, scale, stride_kb, stride_ks, stride_kh, stride_bt,
                                    b, kvh, q_pos, 0, kv_end, tree_bits, tree_start, m, den, acc, BLOCK, DIM, TILE,
                                    STAGES, TREE)  # fmt: skip
        tl.store(
            o_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            (acc / den[:, None]).to(o_ptr.dtype.element_ty),
            mask=valid[:, None],
        )

    @triton.jit(do_not_specialize=["stride_bt"])
    def _uniform_paged_attn(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, part_ptr, stat_ptr, count_ptr, bits_ptr, scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, tree_width,
        Q_LEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        TILE: tl.constexpr, STAGES: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr,
        TREE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, ROW_TILES: tl.constexpr,
    ):  # fmt: skip
        # program (b, kvh, split * ROW_TILES + row tile): a sequence's keys are cut into up to MAX_SPLITS
        # ranges of at least SPLIT_TILES tiles, so a long sequence is read by several programs at once, and
        # its Q_LEN * GROUP query rows into ROW_TILES tiles of ROWS (a tree verify's many rows). One range: a
        # program stores its rows' output itself. Several: each stores its partial softmax, and the last to
        # finish (counted atomically per row tile) merges them, stores the output and resets the counter.
        # EARLY (with PDL): before waiting for the kernel ahead, a program reads its first tile of keys,
        # except the step's own Q_LEN rows per sequence: those, and q, are what that kernel writes.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2) // ROW_TILES
        row_tile = tl.program_id(2) % ROW_TILES
        kv_heads = tl.num_programs(1)
        seq_len = tl.load(lens_ptr + b)
        n_tiles = tl.cdiv(seq_len, TILE)
        splits = tl.minimum(MAX_SPLITS, tl.cdiv(n_tiles, SPLIT_TILES))
        if split < splits:
            per = tl.cdiv(n_tiles, splits)
            kv_start = split * per * TILE
            kv_end = tl.minimum(seq_len, (split + 1) * per * TILE)
            written = seq_len - Q_LEN  # keys from here on belong to this step's rows
            d = tl.arange(0, DIM)
            kpos = kv_start + tl.arange(0, TILE)
            inside = kpos < kv_end
            if EARLY:
                addr = _tile_addr(tables_ptr, b, kvh, kpos, inside, stride_kb, stride_ks, stride_kh, stride_bt, BLOCK)
                cached = (inside & (kpos < written))[:, None]
                k = tl.load(k_ptr + addr[:, None] + d[None, :], mask=cached, other=0.0)
                v = tl.load(v_ptr + addr[:, None] + d[None, :], mask=cached, other=0.0)
            wait_for_inputs(PDL)
            local = tl.arange(0, ROWS)
            r = row_tile * ROWS + local
            qi = r // GROUP
            row = b * Q_LEN + qi
            head = kvh * GROUP + r % GROUP
            valid = r < Q_LEN * GROUP
            out = o_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
            q = tl.load(
                q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            bits = qi.to(tl.int64)
            if TREE:
                bits = tl.load(bits_ptr + row, mask=valid, other=0)
            q_pos = seq_len - Q_LEN + qi
            m, den, acc = _softmax_start(ROWS, DIM)
            rest = kv_start
            if EARLY:
                fresh = (inside & (kpos >= written))[:, None]
                k = tl.load(k_ptr + addr[:, None] + d[None, :], mask=fresh, other=k)
                v = tl.load(v_ptr + addr[:, None] + d[None, :], mask=fresh, other=v)
                m, den, acc = _attend_tile(q, k, v, kpos, q_pos, m, den, acc, scale, bits, seq_len - tree_width, TREE)
                rest = kv_start + TILE
            acc, m, den = _attend_range(
                q, k_ptr, v_ptr, tables_ptr, scale, stride_kb, stride_ks, stride_kh, stride_bt, b, kvh,
                q_pos, rest, kv_end, bits, seq_len - tree_width, m, den, acc, BLOCK, DIM, TILE, STAGES, TREE,
            )  # fmt: skip
            if splits == 1:
                tl.store(out, (acc / den[:, None]).to(o_ptr.dtype.element_ty), mask=valid[:, None])
            else:
                group = (b * kv_heads + kvh) * ROW_TILES + row_tile
                slot = group * MAX_SPLITS + split
                tl.store(part_ptr + slot * ROWS * DIM + local[:, None] * DIM + d[None, :], acc)
                tl.store(stat_ptr + slot * 2 * ROWS + local, m)
                tl.store(stat_ptr + slot * 2 * ROWS + ROWS + local, den)
                tl.debug_barrier()  # every thread's partial is written before the count moves
                done = tl.atomic_add(count_ptr + group, 1, sem="acq_rel")
                tl.debug_barrier()
                if done == splits - 1:
                    big_m, total, merged = _softmax_start(ROWS, DIM)
                    for t in range(0, splits):
                        src = group * MAX_SPLITS + t
                        m_t = tl.load(stat_ptr + src * 2 * ROWS + local, cache_modifier=".cg")
                        den_t = tl.load(stat_ptr + src * 2 * ROWS + ROWS + local, cache_modifier=".cg")
                        acc_t = tl.load(
                            part_ptr + src * ROWS * DIM + local[:, None] * DIM + d[None, :], cache_modifier=".cg"
                        )
                        m_new = tl.maximum(big_m, m_t)
                        keep, take = tl.exp(big_m - m_new), tl.exp(m_t - m_new)
                        total = total * keep + den_t * take
                        merged = merged * keep[:, None] + acc_t * take[:, None]
                        big_m = m_new
                    tl.store(out, (merged / total[:, None]).to(o_ptr.dtype.element_ty), mask=valid[:, None])
                    tl.atomic_xchg(count_ptr + group, 0)

    # The block-table width varies from step to step; specialising on it (Triton's divisible-by-16 and
    # equal-to-1 variants) compiled new kernels while serving, 0.5-0.65 s each (measured at git 3de923b).
    @triton.jit(do_not_specialize=["stride_bt"])
    def _ragged_paged_attn(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, qstart_ptr, qlen_ptr, lens_ptr, bits_ptr, scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, tree_width,
        GROUP: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        TILE: tl.constexpr, STAGES: tl.constexpr, TREE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(qlen_ptr + b)
        if tile * QB < q_len:
            seq_len = tl.load(lens_ptr + b)
            r = tl.arange(0, ROWS)
            qi = tile * QB + r // GROUP
            row = (tl.load(qstart_ptr + b) + qi).to(tl.int64)
            kv_end = seq_len - q_len + tl.minimum((tile + 1) * QB, q_len)  # past the tile's last position
            valid = (r < QB * GROUP) & (qi < q_len)
            bits = row
            if TREE:
                bits = tl.load(bits_ptr + row, mask=valid, other=-1)
            _attend_rows(
                q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks,
                stride_kh, stride_bt, b, kvh, row, kvh * GROUP + r % GROUP, valid,
                seq_len - q_len + qi, kv_end, bits, seq_len - tree_width, ROWS, BLOCK, DIM, TILE, STAGES, TREE,
            )  # fmt: skip


# Keys per loop iteration (several cache blocks, so fewer dependent round trips per sequence) and the key
# loop's pipelining depth (None: the launch default). The uniform values are measured on an H200
# (bench/probes/kernel_check.py: 128 keys and depth 2 beat 64 keys by 25-40% at batch 1 and 64).
UNIFORM_TILE, UNIFORM_STAGES = 128, 2
RAGGED_TILE, RAGGED_STAGES = 64, None


def kv_tile(block_size: int, tile: int) -> int:
    """Keys handled per loop iteration: `tile`, or one cache block when blocks are larger."""
    return max(tile, triton.next_power_of_2(block_size))


def available() -> bool:
    """True when triton is importable."""
    return triton is not None


# Split-KV decoding: a sequence's keys are shared among up to `split_cap` programs, each with at least
# SPLIT_KEYS keys, so that a small batch of long sequences still fills the GPU. The cap aims at
# SPLIT_PROGRAMS programs in all (two waves of an H200's 132 SMs), so large batches keep one program per
# (sequence, KV head) and never split.
SPLIT_KEYS = 256
SPLIT_PROGRAMS = 264
MAX_SPLITS = 16


def split_cap(batch: int, kv_heads: int) -> int:
    """Most key ranges per (sequence, KV head) for a launch of batch x kv_heads groups (a power of 2)."""
    want = max(1, SPLIT_PROGRAMS // max(1, batch * kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


class _Scratch:
    """Per device: partial softmax results of split programs and one arrival counter per (sequence, KV
    head). Buffers only grow; one that is outgrown stays alive, since captured graphs may point at it. The
    counters are zero between launches (the last program of each group resets its own)."""

    buffers: ClassVar[dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    retired: ClassVar[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    @classmethod
    def get(cls, device: torch.device, groups: int, splits: int, rows_dim: int, rows: int) -> tuple[torch.Tensor, ...]:
        key = (device, rows_dim)
        have = cls.buffers.get(key)
        if have is None or have[2].numel() < groups or have[0].numel() < groups * splits * rows_dim:
            if have is not None:
                cls.retired.append(have)
            n_groups = max(groups, 0 if have is None else have[2].numel())
            n_slots = max(groups * splits, 0 if have is None else have[0].numel() // rows_dim)
            have = (
                torch.empty(n_slots * rows_dim, dtype=torch.float32, device=device),
                torch.empty(n_slots * 2 * rows, dtype=torch.float32, device=device),
                torch.zeros(n_groups, dtype=torch.int32, device=device),
            )
            cls.buffers[key] = have
        return have


def triton_uniform_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    *,
    tree_bits: torch.Tensor | None = None,
    tree_width: int = 0,
    early: bool | None = None,
) -> torch.Tensor:
    """Same contract as `attention.uniform_paged_attention`: q [B*Q, H, D] -> [B*Q, H*D]. With `tree_bits`
    [B*Q] int64, row i sees key seq_len - tree_width + j of the last tree_width (<= 64) only where bit j is
    set (`tree_mask_bits`). `early`: read the first tile of cached keys before waiting for the kernel ahead
    (default: when launched with PDL; the result is the same either way)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    bsz = block_tables.shape[0]
    block, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    group = heads // kv_heads
    rows, row_tiles = row_tiling(q_len * group)
    q = q.contiguous()
    out = torch.empty_like(q)
    tile = kv_tile(block, UNIFORM_TILE)
    splits = split_cap(bsz * row_tiles, kv_heads)
    part, stat, count = _Scratch.get(
        q.device, groups=bsz * kv_heads * row_tiles, splits=splits, rows_dim=rows * dim, rows=rows
    )
    tree = tree_bits is not None
    # the kernel ahead (norm_qkv_rope, or rope_write_kv after cuBLAS) releases it early
    on = pdl.active(q, pdl.ATTENTION_STEP_ROWS)
    _uniform_paged_attn[(bsz, kv_heads, splits * row_tiles)](
        q, k_cache, v_cache, out, block_tables, seq_lens, part, stat, count, tree_bits if tree else seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tree_width, Q_LEN=q_len, GROUP=group, ROWS=rows, BLOCK=block, DIM=dim, TILE=tile, STAGES=UNIFORM_STAGES,
        MAX_SPLITS=splits, SPLIT_TILES=max(1, SPLIT_KEYS // tile), TREE=tree, PDL=on,
        EARLY=on if early is None else early, ROW_TILES=row_tiles, **pdl.launch_args(on),
    )  # fmt: skip
    return out.reshape(bsz * q_len, heads * dim)


# Query rows (step rows x heads of a KV group) one uniform program holds at most: a tree verify at Llama-3-8B's
# shape has 17 x 4 = 68; in one program of 128 rows they took 1.06 ms a step over 32 layers on an H200, against
# 0.28 ms for the 4 rows of decoding (bench/probes/profile_step.py), with 16 programs for 132 SMs.
PROGRAM_ROWS = 32


def row_tiling(total: int) -> tuple[int, int]:
    """(rows per program, programs per sequence and KV head) for `total` query rows: one tile of the next
    power of two (at least 16) up to PROGRAM_ROWS, else tiles of PROGRAM_ROWS."""
    rows = max(16, triton.next_power_of_2(total))
    if rows <= PROGRAM_ROWS:
        return rows, 1
    return PROGRAM_ROWS, -(-total // PROGRAM_ROWS)


TREE_BITS = 64  # widest tree mask the kernel reads: one int64 per row


def tree_mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tree mask [B, Q, W] (W <= 64) as one int64 per row [B*Q]: bit j set where the row sees key j."""
    width = mask.shape[-1]
    if width > TREE_BITS:
        raise ValueError(f"tree masks of {width} keys exceed the kernel's {TREE_BITS}")
    weights = torch.ones(width, dtype=torch.long, device=mask.device) << torch.arange(width, device=mask.device)
    return (mask.long() * weights).sum(-1).reshape(-1)


def triton_ragged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_q_len: int,
    scale: float,
    q_block: int = 16,
    tree_bits: torch.Tensor | None = None,
    tree_width: int = 0,
) -> torch.Tensor:
    """Causal attention of ragged rows q [T, H, D]: sequence b owns rows [q_starts[b], + q_lens[b]), which
    are its last q_lens[b] positions of seq_lens[b]. Returns [T, H*D]. With `tree_bits` [T] int64, a row sees
    key seq_len - tree_width + j (j < 64) only where bit j is set (-1: every key, as plain causal rows)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    bsz = block_tables.shape[0]
    block, kv_heads, dim = k_cache.shape[1:]
    t, heads = q.shape[0], q.shape[1]
    group = heads // kv_heads
    rows = max(16, triton.next_power_of_2(q_block * group))
    q = q.contiguous()
    out = torch.empty_like(q)
    if t and bsz:
        tree = tree_bits is not None
        _ragged_paged_attn[(bsz, kv_heads, triton.cdiv(max_q_len, q_block))](
            q, k_cache, v_cache, out, block_tables, q_starts, q_lens, seq_lens, tree_bits if tree else q_lens, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            tree_width, GROUP=group, QB=q_block, ROWS=rows, BLOCK=block, DIM=dim,
            TILE=kv_tile(block, RAGGED_TILE), STAGES=RAGGED_STAGES, TREE=tree,
        )  # fmt: skip
    return out.reshape(t, heads * dim)
