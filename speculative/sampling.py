"""Turning logits into token distributions (temperature, top-k, top-p) and sampling them from thresholds.

Every sampled token is drawn by inverse CDF at a threshold (a number in [0, 1)) that depends only on the request's
key and the token's position (`keyed_thresholds`); drafts are accepted where they equal those draws
(`speculative/verify.py`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from enum import Enum
from typing import Protocol

import torch


class SamplingMode(Enum):
    """What a step's requests need from the logits, hence which captured variant of a step runs."""

    GREEDY = "greedy"  # every request decodes greedily: argmax only
    TEMPERATURE = "temperature"  # some sample, none restricts by top-k or top-p: no sort over the vocabulary
    FILTERED = "filtered"  # some restrict by top-k or top-p


class SamplingParamsLike(Protocol):
    """A request's sampling settings (SamplingParams, SeqPlan)."""

    temperature: float
    top_k: int
    top_p: float


def sampling_mode(requests: Sequence[SamplingParamsLike]) -> SamplingMode:
    """The cheapest mode that serves every request of a step."""
    sampling = [r for r in requests if r.temperature > 0]
    if not sampling:
        return SamplingMode.GREEDY
    if any(r.top_k > 0 or r.top_p < 1 for r in sampling):
        return SamplingMode.FILTERED
    return SamplingMode.TEMPERATURE


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """Per-row token distribution [N, V]; rows with temperature 0 become one-hot at the argmax.

    logits [N, V] float; temperature [N]; top_k [N] (0 = off); top_p [N] in (0, 1]. With filtered=False
    top_k and top_p are ignored (every row must have them off), which skips sorting the vocabulary.
    """
    v = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    one_hot = torch.zeros_like(scaled).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if not filtered:
        return torch.where(greedy[:, None], one_hot, torch.softmax(scaled, dim=-1))
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(v, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    drop = ranks >= k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)  # top-p 1 keeps the tail the fp32 sum rounds off
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_at_threshold(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: the first token whose cumulative mass exceeds u * total. probs [..., V], u [...]."""
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


KEY_MASK = 0x7FFFFFFF  # a request's sampling key fits a non-negative int32 (so it can ride in float buffers)


def sampling_key(seed: int | None) -> int:
    """A request's sampling key: a hash of its seed, or a random one when it has none."""
    if seed is None:
        return secrets.randbits(31)
    folded = (seed ^ (seed >> 31) ^ (seed >> 62)) & KEY_MASK
    return int(_mix(torch.tensor(folded, dtype=torch.long))) & KEY_MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x (int64 holding values below 2**32; every product stays below 2**63)."""
    m = 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    return (x >> 16) ^ x


def keyed_thresholds(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The threshold in [0, 1) that decides the token at each position, float32, broadcast over keys and positions
    (int64; keys from `sampling_key`). A function of the key and the position alone, so a request samples the
    same tokens however its steps fall: with or without drafts, any draft kind, any batch or chunking.

    Example: a request with key 7 emits its tokens at positions 130, 131, ...; the token at 131 takes
    u = keyed_thresholds(7, 131) whether it is a decode step's only row, the third row of a K=3 verify or
    a tree node of depth 2, and whichever step it falls in."""
    x = _mix((positions & 0xFFFFFFFF) ^ 0x5BD1E995)
    x = _mix(x ^ keys.to(torch.long))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
