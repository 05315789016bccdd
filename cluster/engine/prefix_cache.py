"""The scheduler's prefix cache over a request: attaching cached blocks at admission and keying full blocks as
they fill (keys from `prefix_keys.py`, blocks from `block_manager.py`)."""

from __future__ import annotations

from mtpserve.cluster.engine.block_manager import BlockManager
from mtpserve.cluster.engine.prefix_keys import extend_keys, num_keyable_blocks
from mtpserve.cluster.engine.request import Request


def request_keys(req: Request, n: int, block_size: int) -> list[bytes]:
    """The request's block keys, computed up to block n (reading only the tokens not yet keyed)."""
    return extend_keys(req.block_keys, req.token_ids_from(len(req.block_keys) * block_size), block_size, n)


def attach_cached(blocks: BlockManager, req: Request, block_size: int) -> None:
    """Give a request without blocks the cached blocks of its longest known prefix."""
    if req.block_ids:
        return
    n = num_keyable_blocks(req.num_tokens, block_size)
    req.block_ids = blocks.match(request_keys(req, n, block_size)[:n])
    req.num_keyed_blocks = len(req.block_ids)
    req.num_computed_tokens = len(req.block_ids) * block_size


def register_blocks(blocks: BlockManager, req: Request, block_size: int) -> None:
    """Key the request's full blocks whose target and draft KV are final."""
    if req.num_computed_tokens // block_size <= req.num_keyed_blocks:
        return  # no block has filled since the last call (most steps)
    n = min(req.num_computed_tokens // block_size, len(req.block_ids), num_keyable_blocks(req.num_tokens, block_size))
    if n <= req.num_keyed_blocks:
        return
    keys = request_keys(req, n, block_size)
    for b in range(req.num_keyed_blocks, n):
        blocks.register(req.block_ids[b], keys[b])
    req.num_keyed_blocks = n
