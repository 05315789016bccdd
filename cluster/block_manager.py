"""KV-cache block accounting: a free list of fixed-size blocks shared by all requests."""

from __future__ import annotations


class BlockManager:
    """Hands out and takes back KV block ids; knows how many blocks a token count needs."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend `block_ids` in place to cover `num_tokens` slots; False (and no change) if short of blocks."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            block_ids.append(self._free.pop())
        return True

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool and empty the list."""
        self._free.extend(reversed(block_ids))
        block_ids.clear()
