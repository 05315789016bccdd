"""Paged KV-cache storage: one fixed set of block tensors per model, indexed by slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Key and value block tensors for every layer, shape [num_blocks, block_size, kv_heads, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    stacked: torch.Tensor | None = None  # [2, layers, num_blocks + 1, block_size, kv_heads, head_dim]: every
    # layer's keys and values are views of it (so one copy moves slots in all layers); None: separate tensors

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Allocate zeroed caches once (plus one scratch block for padding rows), every layer a view of one
        tensor; addresses never change."""
        stacked = torch.zeros(
            2, num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        layers = range(num_layers)  # one view each (not `unbind`, whose views autograd will not let us write)
        return cls([stacked[0, i] for i in layers], [stacked[1, i] for i in layers], block_size, stacked)

    @property
    def num_blocks(self) -> int:
        """Usable blocks per layer (the scratch block excluded)."""
        return self.keys[0].shape[0] - 1

    @property
    def scratch_block(self) -> int:
        """Block id that padding rows of captured steps write to; never handed to a request."""
        return self.keys[0].shape[0] - 1

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (keys, values) [N, kv_heads, head_dim] stored at `slots` of one layer."""
        k = self.keys[layer].view(-1, *self.keys[layer].shape[2:])[slots]
        v = self.values[layer].view(-1, *self.values[layer].shape[2:])[slots]
        return k, v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys and values at slots `src` [N] to slots `dst` [N] (all sources read first)."""
        if self.stacked is not None:
            flat = self.stacked.view(2 * len(self.keys), -1, *self.stacked.shape[4:])
            flat.index_copy_(1, dst, flat.index_select(1, src))
            return
        for t in self.keys + self.values:
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def nbytes(self) -> int:
        """Total bytes held."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class KVWrite:
    """Where one layer's new k and v go, and how q and k are rotated first: RoPE cos/sin rows ([T, 1, D] or
    [T, D], fp32), the cache slot of each row, the layer's paged caches and its head layout."""

    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
