"""Verification of K drafts against the target.

Terms. For one request with drafts d_1..d_K, verify rows 0..K predict the tokens at positions s+1..s+K+1:
- p_j: the target's distribution at row j, after temperature/top-k/top-p; a one-hot at the argmax when
  temperature is 0.
- u_j: the threshold of the token's position, from the request's key (`keyed_thresholds`).
- y_j: the target's own draw at row j, the first token whose cumulative mass under p_j exceeds u_j.
Drafts chosen by the draft model deterministically (every drafter here: greedy chains, top-k trees) are
accepted while d_j = y_{j-1}; the step emits y_0..y_n, n the accepted count. Each emitted token is the draw
target-only decoding would make at that position with the same threshold, so the output is the target's own
sampling, token for token: it does not depend on the drafts, their kind or the step they fall in. A draft
is accepted with probability p(d), as rejection sampling against a one-hot draft accepts it (Leviathan et
al. 2023), so acceptance is the same. With one-hot p the rule is "longest prefix matching the argmax, plus
the argmax after it". Drafts sampled from a distribution q (`draft_probs`) go through rejection sampling:
accept d_j when u_j q(d_j) < p(d_j), else draw from norm(max(0, p - q)).

Example, K=2, drafts "the", "cat": the keyed draws at rows 0, 1, 2 are "the", "dog", "sat". Draft 1 equals
y_0 and is accepted; draft 2 does not equal y_1, so the step emits "the", "dog" (n = 1), and row 2 is
discarded. Target-only decoding with the same key draws "the", then "dog" at those positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from mtpserve.speculative.messages import SeqPlan
from mtpserve.speculative.sampling import processed_probs, sample_at_threshold


def verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    thresholds: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts; returns (num_accepted [B], tokens [B, K+1]).

    target_probs [B, K+1, V]; draft_tokens [B, K]; thresholds [B, K+1] in [0, 1), one per row (the keyed
    thresholds of the positions the rows predict); draft_probs [B, K, V], or None for drafts chosen
    deterministically. tokens[b, :num_accepted[b] + 1] are the emitted tokens; the rest is padding (for
    deterministic drafts, the target's draws at every row). No host sync.
    """
    bsz, k1, _ = target_probs.shape
    k = k1 - 1
    if draft_probs is None:
        draws = sample_at_threshold(target_probs, thresholds)  # [B, K+1], the target's own tokens
        match = (draft_tokens == draws[:, :k]).to(torch.int64)
        return torch.cumprod(match, dim=1).sum(dim=1), draws
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept = thresholds[:, :k] * q_draft < p_draft  # u < p/q without dividing by zero
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [B]
    residual = target_probs.clone()
    residual[:, :k] = (residual[:, :k] - draft_probs).clamp_(min=0)
    rows = torch.arange(bsz, device=target_probs.device)
    final_dist = residual[rows, num_accepted]  # [B, V]; p_K itself when all were accepted
    empty = final_dist.sum(-1, keepdim=True) <= 0  # p == q exactly: fall back to p
    final_dist = torch.where(empty, target_probs[rows, num_accepted], final_dist)
    final_tok = sample_at_threshold(final_dist, thresholds[:, k])

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)
    tokens[rows, num_accepted] = final_tok
    return num_accepted, tokens


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy special case without distributions: target_argmax [B, K+1], draft_tokens [B, K].

    Returns (num_accepted [B], tokens [B, K+1]) with tokens = target_argmax: the accepted drafts equal
    it, and the token after them is the target's own choice (correction or bonus).
    """
    match = (draft_tokens == target_argmax[:, :-1]).to(torch.int64)
    return torch.cumprod(match, dim=1).sum(dim=1), target_argmax


class ForcedAcceptance(Protocol):
    """Benchmarks only: recorded acceptance that greedy verify steps take in place of comparing drafts with the
    target's tokens (`speculative/replay.py`'s `ReplayAcceptance`; the served path never makes one)."""

    def take(self, seqs: Sequence[SeqPlan], width: int) -> np.ndarray:
        """Rows [len(seqs), width] for a step: each sequence's accepted count, then its accepted node indices
        (a tree's branch), 0-padded; read by `forced_chain` and `tree.forced_walk`."""
        ...


def forced_chain(
    target_argmax: torch.Tensor, drafts: torch.Tensor, forced: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_greedy` with the accepted counts read from forced rows [B, >=1]: returns (num_accepted [B],
    tokens [B, K+1]), the first num_accepted drafts then the target's token after them. target_argmax
    [B, K+1], drafts [B, K]."""
    k = drafts.shape[1]
    n_acc = forced[:, 0].clamp(0, k)
    padded = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    columns = torch.arange(k + 1, device=drafts.device)
    return n_acc, torch.where(columns[None, :] < n_acc[:, None], padded, target_argmax)


class Scorer(Protocol):
    """What verification needs of the target model: logits, and greedy tokens (possibly fused)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of hidden rows [N, d]."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of `logits(hidden)` per row [N]."""
        ...


def verify_step(
    target: Scorer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    q_len: int,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    filtered: bool = True,
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a uniform step of B sequences x Q rows in fixed shapes (safe to capture in a CUDA graph).

    hidden [B*Q, d] are the target's rows; input_ids [B*Q], each sequence's last accepted token then its
    Q-1 drafts. sampling is None for an all-greedy step (only argmax tokens are computed), else
    (temperature [B], top_k [B] (float), top_p [B], thresholds [B, Q]); greedy rows within it (temperature 0)
    verify exactly as greedy; `filtered` False skips top-k/top-p (see `processed_probs`). `forced` [B, >=1]
    replays recorded accept counts in an all-greedy step (`speculative/replay.py`). Returns
    (num_accepted [B], tokens [B, Q]).
    """
    bsz = input_ids.shape[0] // q_len
    drafts = input_ids.view(bsz, q_len)[:, 1:]
    if sampling is None:
        argmax = target.greedy_tokens(hidden).view(bsz, q_len)
        return verify_greedy(argmax, drafts) if forced is None else forced_chain(argmax, drafts, forced)
    temperature, top_k, top_p, thresholds = sampling
    probs = processed_probs(
        target.logits(hidden),
        temperature.repeat_interleave(q_len),
        top_k.long().repeat_interleave(q_len),
        top_p.repeat_interleave(q_len),
        filtered=filtered,
    )
    return verify(probs.view(bsz, q_len, -1), drafts, thresholds)
