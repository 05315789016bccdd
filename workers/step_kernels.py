"""Inputs of an overlapped speculative step, taken on the device from the previous step's results.

A speculative step launched before the previous one has been read gets, per sequence, its tokens (the last
emitted token, then the new drafts), positions, KV slots and length from the previous step's packed
results [emitted K+1 | accepted | drafts K | next start]. In torch that is about fifteen small launches;
`advance_inputs` on CUDA does it in one Triton launch (CPU tests run the same kernel via TRITON_INTERPRET)
and `advance_reference` is the torch version used elsewhere.
"""

from __future__ import annotations

import torch

from mtpserve.modeling.fused_kernels import _need_triton
from mtpserve.workers.step_buffers import StepBuffers

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:

    @triton.jit
    def _advance(
        prev_ptr, ids_ptr, pos_ptr, slot_ptr, lens_ptr, tables_ptr, stride_prev, stride_bt, block_size,
        Q: tl.constexpr, QP: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        i = tl.arange(0, QP)
        inside = i < Q
        row = tl.load(ids_ptr + b * Q)  # the sequence's row in the previous results, written by fill_step
        src = prev_ptr + row * stride_prev
        accepted = tl.load(src + Q)
        start = tl.load(src + 2 * Q)
        tokens = tl.load(src + tl.where(i == 0, accepted, Q + i), mask=inside, other=0)
        pos = start + i
        block = tl.load(tables_ptr + b * stride_bt + pos // block_size, mask=inside, other=0)
        tl.store(ids_ptr + b * Q + i, tokens, mask=inside)
        tl.store(pos_ptr + b * Q + i, pos, mask=inside)
        tl.store(slot_ptr + b * Q + i, block * block_size + pos % block_size, mask=inside)
        tl.store(lens_ptr + b, start + Q)


def advance_reference(previous: torch.Tensor, buffers: StepBuffers, m: int, row_offsets: torch.Tensor) -> None:
    """Overwrite the first m sequences' tokens, positions, slots and lengths in `buffers` from `previous`
    [*, 2Q+1]; each sequence's first token slot holds its row there. row_offsets is arange(Q)."""
    b, q = buffers, buffers.q_len
    k = q - 1
    src = previous.index_select(0, b.input_ids.view(-1, q)[:m, 0])
    n_acc = src[:, q : q + 1]
    ids = torch.cat([src.gather(1, n_acc), src[:, q + 1 : q + 1 + k]], dim=1)
    start = src[:, -1:]
    pos = start + row_offsets
    bs = b.block_size
    slots = b.block_tables[:m].gather(1, pos // bs) * bs + pos % bs
    b.input_ids[: m * q].copy_(ids.reshape(-1))
    b.positions[: m * q].copy_(pos.reshape(-1))
    b.slot_mapping[: m * q].copy_(slots.reshape(-1))
    b.seq_lens[:m].copy_(start[:, 0] + q)


def advance_inputs(previous: torch.Tensor, buffers: StepBuffers, m: int) -> None:
    """`advance_reference` in one Triton launch."""
    _need_triton()
    b, q = buffers, buffers.q_len
    if previous.shape[1] != 2 * q + 1 or previous.stride(1) != 1:
        raise ValueError(
            f"previous results must be [*, {2 * q + 1}] with unit column stride, got {tuple(previous.shape)}"
        )
    if m:
        _advance[(m,)](
            previous, b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.block_tables,
            previous.stride(0), b.block_tables.stride(0), b.block_size, Q=q, QP=triton.next_power_of_2(q),
        )  # fmt: skip
