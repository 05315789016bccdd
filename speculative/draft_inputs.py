"""Draft-row token selection: shifted context, prompt lookahead at chunk ends, accepted tokens."""

from __future__ import annotations

import torch

from mtpserve.speculative.lookahead import INVALID_TOKEN


def last_rows(seq_lens: torch.Tensor) -> torch.Tensor:
    """Index of each sequence's last row in the flattened batch."""
    return torch.cumsum(seq_lens, 0) - 1


def draft_input_tokens(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    context_index: torch.Tensor,
    lookahead: torch.Tensor,
    sampled_tokens: torch.Tensor,
    lookahead_source: str = "prompt",
) -> torch.Tensor:
    """Tokens the draft reads at each row: row i of a sequence takes the token at i+1.

    token_ids      [T] target input tokens, sequences back to back
    seq_lens       [B] rows per sequence
    context_index  [B] j for the j-th context sequence, -1 for generation rows
    lookahead      [M] the worker's lookahead tensor (entry j, or -1)
    sampled_tokens [B] the target's token at each sequence's last row
    A sequence's last row takes its lookahead when that is not -1 (a non-final context chunk under
    `prompt`), else the sampled token. Under `sampled` the lookahead is ignored (pre-fix behaviour).

    Example: prompt [5, 6, 7, 8, 9] in chunks of 3, then a generation row.
      chunk [5, 6, 7] (lookahead 8):    the draft reads [6, 7, 8]  (8 is the next prompt token)
      chunk [8, 9] (final, lookahead -1), the target samples 11:  [9, 11]
      generation [11, d1] with d1 accepted and the bonus 13:     [d1, 13]
    Under `sampled` the first chunk's last row would read the target's guess after 7 instead of 8, so the
    draft's KV would depend on where the chunks end.
    """
    shifted = torch.roll(token_ids, -1)
    ends = last_rows(seq_lens)
    if lookahead_source == "prompt":
        look = torch.where(context_index >= 0, lookahead[context_index.clamp(min=0)], INVALID_TOKEN)
        last = torch.where(look != INVALID_TOKEN, look, sampled_tokens)
    elif lookahead_source == "sampled":
        last = sampled_tokens
    else:
        raise ValueError(f"lookahead_source must be 'prompt' or 'sampled', got {lookahead_source!r}")
    shifted[ends] = last.to(shifted.dtype)
    return shifted
