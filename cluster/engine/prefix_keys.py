"""Content keys of full KV blocks, for prefix caching that keeps the draft head's coupling right.

The draft head's KV row i is computed from (token i+1, target hidden i), so the last row of a block
depends on the first token after the block. A block's key therefore covers its own tokens, the token
that follows it and the key of the block before it: two sequences share a block's key only when they
agree on every token up to and including that next token, and then the target and the draft KV of
the block are the same for both.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_KEY = b"mtpserve-prefix-v1"


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block whose tokens and following token are `tokens` (block_size + 1 of them)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def num_keyable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a sequence of `num_tokens` known tokens whose following token is known too."""
    return max(0, (num_tokens - 1) // block_size)


def extend_keys(keys: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Append to `keys` (the keys of the first len(keys) blocks) until it holds `num_blocks` keys;
    `token_ids` are the sequence's tokens from the first block without a key on."""
    first = len(keys)
    need = (num_blocks - first) * block_size + 1
    if num_blocks > first and len(token_ids) < need:
        raise ValueError(
            f"blocks {first}..{num_blocks - 1} need {need} known tokens from the first, have {len(token_ids)}"
        )
    parent = keys[-1] if keys else ROOT_KEY
    for j in range(num_blocks - first):
        parent = block_key(parent, token_ids[j * block_size : (j + 1) * block_size + 1])
        keys.append(parent)
    return keys
