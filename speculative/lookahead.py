"""The per-worker prompt-lookahead tensor: fixed address, entry j = j-th context request's next token."""

from __future__ import annotations

import torch

INVALID_TOKEN = -1


class LookaheadBuffer:
    """A [max_num_requests] token tensor allocated once and rewritten in place every step.

    Entry j holds the lookahead token of the j-th context request of the step: the sequence token at
    the chunk end for a non-final chunk, or -1 for a final chunk. Every other entry is -1. The tensor
    is never reallocated, so CUDA graphs captured over it stay valid.
    """

    def __init__(self, max_num_requests: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.int64):
        self.tokens = torch.full((max_num_requests,), INVALID_TOKEN, dtype=dtype, device=device)
        self._host = torch.full((max_num_requests,), INVALID_TOKEN, dtype=dtype)
        if self.tokens.is_cuda:
            self._host = self._host.pin_memory()

    @property
    def capacity(self) -> int:
        """max_num_requests."""
        return self.tokens.shape[0]

    def write(self, lookahead_tokens: torch.Tensor | list[int], host: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's per-context-request tokens at entries 0..C-1 and -1 everywhere else, staged
        through `host` when given (a buffer like `staging()` that no queued copy still reads)."""
        src = torch.as_tensor(lookahead_tokens, dtype=self.tokens.dtype)
        c = src.numel()
        if c > self.capacity:
            raise ValueError(f"{c} context requests exceed max_num_requests={self.capacity}")
        host = self._host if host is None else host
        host.fill_(INVALID_TOKEN)
        host[:c].copy_(src)
        self.tokens.copy_(host, non_blocking=True)
        return self.tokens

    def staging(self) -> torch.Tensor:
        """A host buffer to stage writes through (pinned for a CUDA tensor)."""
        return torch.empty_like(self._host, pin_memory=self.tokens.is_cuda)


def lookahead_for_chunk(sequence: list[int], chunk_end: int, is_final_chunk: bool) -> int:
    """The token the draft row at chunk_end-1 reads: sequence[chunk_end] unless this is the final chunk."""
    if is_final_chunk:
        return INVALID_TOKEN
    if chunk_end >= len(sequence):
        raise ValueError(f"non-final chunk ends at {chunk_end} but the sequence has {len(sequence)} tokens")
    return sequence[chunk_end]
