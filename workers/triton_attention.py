"""Triton paged attention on CUDA: uniform generation steps (decode, verify) and ragged batches
(prefill chunks mixed with generation rows).

Uniform: one program per (sequence, KV head) handles the Q query rows of every query head in that KV
group, walking the sequence's block table with an online softmax, 64 keys (several cache blocks,
gathered through the table) per iteration. It reads only the blocks a sequence
uses, and all its sizes are read on device, so it can be captured in a CUDA graph.
Ragged: the same walk, with a third program axis over tiles of QB query positions, each sequence's
query count and row offset read on device, and each tile stopping at its last position's causal limit.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _attend_rows(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_bt, b, kvh, row, head, valid, q_pos, kv_end,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        # online-softmax attention of query rows (flat row, head) of sequence b over its first kv_end keys
        d = tl.arange(0, DIM)
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=valid[:, None], other=0.0
        )
        m = tl.full((ROWS,), -1.0e30, tl.float32)
        den = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, DIM), tl.float32)
        s = tl.arange(0, TILE)
        for j in tl.range(0, tl.cdiv(kv_end, TILE), num_stages=STAGES):
            kpos = j * TILE + s
            inside = kpos < kv_end
            blk = tl.load(tables_ptr + b * stride_bt + kpos // BLOCK, mask=inside, other=0).to(tl.int64)
            addr = blk * stride_kb + (kpos % BLOCK) * stride_ks + kvh * stride_kh
            k = tl.load(k_ptr + addr[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + addr[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            scores = tl.where(kpos[None, :] <= q_pos[:, None], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = acc / den[:, None]
        tl.store(
            o_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=valid[:, None],
        )

    @triton.jit
    def _uniform_paged_attn(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
        Q_LEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        TILE: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.arange(0, ROWS)
        qi = r // GROUP
        seq_len = tl.load(lens_ptr + b)
        _attend_rows(
            q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_bt, b, kvh, b * Q_LEN + qi, kvh * GROUP + r % GROUP, r < Q_LEN * GROUP, seq_len - Q_LEN + qi,
            seq_len, ROWS, BLOCK, DIM, TILE, STAGES,
        )  # fmt: skip

    @triton.jit
    def _ragged_paged_attn(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, qstart_ptr, qlen_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
        GROUP: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        TILE: tl.constexpr, STAGES: tl.constexpr,
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
            _attend_rows(
                q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks,
                stride_kh, stride_bt, b, kvh, row, kvh * GROUP + r % GROUP, (r < QB * GROUP) & (qi < q_len),
                seq_len - q_len + qi, kv_end, ROWS, BLOCK, DIM, TILE, STAGES,
            )  # fmt: skip


# Keys per loop iteration (several cache blocks, so fewer dependent round trips per sequence) and the key
# loop's pipelining depth (None: the launch default). The uniform values are measured on an H200
# (bench/kernel_check.py: 128 keys and depth 2 beat 64 keys by 25-40% at batch 1 and 64).
UNIFORM_TILE, UNIFORM_STAGES = 128, 2
RAGGED_TILE, RAGGED_STAGES = 64, None


def kv_tile(block_size: int, tile: int) -> int:
    """Keys handled per loop iteration: `tile`, or one cache block when blocks are larger."""
    return max(tile, triton.next_power_of_2(block_size))


def available() -> bool:
    """True when triton is importable."""
    return triton is not None


def triton_uniform_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """Same contract as `attention.uniform_paged_attention`: q [B*Q, H, D] -> [B*Q, H*D]."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    bsz = block_tables.shape[0]
    block, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    group = heads // kv_heads
    rows = max(16, triton.next_power_of_2(q_len * group))
    q = q.contiguous()
    out = torch.empty_like(q)
    _uniform_paged_attn[(bsz, kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        Q_LEN=q_len, GROUP=group, ROWS=rows, BLOCK=block, DIM=dim,
        TILE=kv_tile(block, UNIFORM_TILE), STAGES=UNIFORM_STAGES,
    )  # fmt: skip
    return out.reshape(bsz * q_len, heads * dim)


def triton_ragged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    q_block: int = 16,
) -> torch.Tensor:
    """Causal attention of ragged rows q [T, H, D]: sequence b owns rows [q_starts[b], + q_lens[b]), which
    are its last q_lens[b] positions of seq_lens[b]. Returns [T, H*D]."""
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
        _ragged_paged_attn[(bsz, kv_heads, triton.cdiv(max_q_len, q_block))](
            q, k_cache, v_cache, out, block_tables, q_starts, q_lens, seq_lens, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, QB=q_block, ROWS=rows, BLOCK=block, DIM=dim,
            TILE=kv_tile(block, RAGGED_TILE), STAGES=RAGGED_STAGES,
        )  # fmt: skip
    return out.reshape(t, heads * dim)
