"""Tensor-parallel context: rank, world size, head/vocab partitioning and the collectives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """Split range(n) into `parts` contiguous [start, end) ranges whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass
class TPContext:
    """This rank's place in the tensor-parallel group; a size-1 context makes every collective a no-op."""

    rank: int = 0
    size: int = 1
    group: object | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks in place and return it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)  # type: ignore[arg-type]
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's `x` along the last dim; `sizes` are the per-rank widths."""
        if self.size == 1:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)  # type: ignore[arg-type]
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes, strict=True)], dim=-1)

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """KV heads owned by this rank: groups split as evenly as possible (uneven splits allowed)."""
        if self.size > num_kv_heads:
            raise ValueError(
                f"parallel.tp_size={self.size} exceeds the model's {num_kv_heads} KV heads; "
                "use a tp_size no larger than the KV head count"
            )
        return split_evenly(num_kv_heads, self.size)[self.rank]

    def shard_range(self, n: int) -> tuple[int, int]:
        """This rank's contiguous slice of a dimension of size n."""
        return split_evenly(n, self.size)[self.rank]

    def shard_sizes(self, n: int) -> list[int]:
        """Every rank's slice width of a dimension of size n."""
        return [e - s for s, e in split_evenly(n, self.size)]
