"""KV-cache block accounting: reference-counted blocks, and full blocks kept for reuse by content key.

A block is in one of three states: held (reference count > 0), cached (count 0, but its key still maps
to it, so a later request with the same prefix can take it back) or empty. New blocks come from the
empty ones first, then from the least recently freed cached ones, whose keys are forgotten then.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    """Hands out and takes back KV block ids; keeps freed full blocks findable by key until reused."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # count-0 keyed blocks, least recent first
        self._by_key: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds (empty or cached): what new requests can still get."""
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks no request holds whose contents are kept for reuse."""
        return len(self._cached)

    @property
    def num_keyed(self) -> int:
        """Blocks, held or not, that a prefix lookup can find."""
        return len(self._by_key)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold the block."""
        return self._ref[block_id]

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend `block_ids` in place with new blocks to cover `num_tokens` slots; False (and no change)
        if short of blocks."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block_ids.append(self._take())
        return True

    def _take(self) -> int:
        if self._empty:
            b = self._empty.pop()
        else:
            b, _ = self._cached.popitem(last=False)
            key = self._key[b]
            assert key is not None
            del self._by_key[key]
            self._key[b] = None
        self._ref[b] = 1
        return b

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block and empty the list; a block nobody holds stays cached if keyed.
        The list's last blocks become the first to be reused."""
        for b in reversed(block_ids):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} freed more often than taken"
            if self._ref[b] == 0:
                if self._key[b] is None:
                    self._empty.append(b)
                else:
                    self._cached[b] = None
        block_ids.clear()

    def match(self, keys: list[bytes]) -> list[int]:
        """Take a reference to the blocks of the longest run of `keys` (from the first) that are known."""
        found: list[int] = []
        for key in keys:
            b = self._by_key.get(key)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
            found.append(b)
        return found

    def register(self, block_id: int, key: bytes) -> None:
        """Make a held, fully written block findable by `key`; no change if the key (or block) has one."""
        if key in self._by_key or self._key[block_id] is not None:
            return
        self._key[block_id] = key
        self._by_key[key] = block_id

    def forget(self) -> int:
        """Drop every key (cached blocks become empty); returns how many blocks were keyed."""
        n = len(self._by_key)
        for b in self._cached:
            self._empty.append(b)
        self._cached.clear()
        for b in self._by_key.values():
            self._key[b] = None
        self._by_key.clear()
        return n
