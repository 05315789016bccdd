"""The ragged CPU attention metadata against attention written out position by position from the block tables."""

from __future__ import annotations

import random

import pytest
import torch

from mtpserve.modeling.attention import AttentionMetadata

H, HKV, D = 4, 2, 8


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_size: int,
    row_masks: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[int]]:
    """(float64 attention [T, H*D], the slot each new row writes), one row and key at a time."""
    outs, slots, row = [], [], 0
    for start, n, table, rm in zip(starts, counts, tables, row_masks, strict=True):
        end = start + n
        key_slots = [table[p // block_size] * block_size + p % block_size for p in range(end)]
        keys = k_cache.view(-1, HKV, D)[key_slots].double()
        values = v_cache.view(-1, HKV, D)[key_slots].double()
        slots += key_slots[start:end]
        for i in range(n):
            visible = torch.arange(end) <= start + i
            if rm is not None:
                visible[end - rm.shape[1] :] &= rm[i]
            heads = []
            for h in range(H):
                kv = h // (H // HKV)
                scores = (keys[:, kv] @ q[row + i, h].double()) / D**0.5
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
                heads.append(probs @ values[:, kv])
            outs.append(torch.cat(heads))
        row += n
    return torch.stack(outs), slots


@pytest.mark.parametrize("seed", range(6))
def test_ragged_metadata_attends_like_the_block_tables_say(seed: int) -> None:
    """Random chunks, decode rows and tree-masked rows over shuffled blocks: same slots, same attention."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    num_blocks = 96
    free = list(range(num_blocks))
    rng.shuffle(free)
    starts, counts, tables, masks = [], [], [], []
    for _ in range(rng.randint(1, 7)):
        start, n = rng.randint(0, 40), rng.choice([1, 1, 2, 4, rng.randint(1, 20)])
        need = -(-(start + n) // block_size)
        tables.append([free.pop() for _ in range(need + rng.randint(0, 2))])
        starts.append(start)
        counts.append(n)
        if n > 1 and rng.random() < 0.4:
            width = rng.randint(n, start + n)
            m = torch.rand(n, width, generator=torch.Generator().manual_seed(seed)) < 0.6
            m[:, -n:] |= torch.eye(n, dtype=torch.bool)  # each row sees itself
            masks.append(m)
        else:
            masks.append(None)
    g = torch.Generator().manual_seed(100 + seed)
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    q = torch.randn(sum(counts), H, D, generator=g)

    meta = AttentionMetadata.build(starts, counts, tables, block_size, row_masks=masks)
    want, slots = reference(q, k_cache, v_cache, starts, counts, tables, block_size, masks)
    assert meta.slot_mapping.tolist() == slots
    got = meta.attend(q, k_cache, v_cache, D**-0.5)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_too_few_blocks_and_bad_row_masks_are_refused() -> None:
    """A sequence whose positions need more blocks than its table holds, or a mask of the wrong shape."""
    with pytest.raises(ValueError, match="sequence 1 needs 9 slots but has 2 blocks"):
        AttentionMetadata.build([0, 5], [3, 4], [[0], [1, 2]], 4)
    with pytest.raises(ValueError, match=r"row mask of sequence 0 is \(2, 1\)"):
        AttentionMetadata.build([3], [2], [[0, 1]], 4, row_masks=[torch.ones(2, 1, dtype=torch.bool)])
