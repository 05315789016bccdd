"""Turning logits into token distributions (temperature, top-k, top-p) and sampling them from uniforms."""

from __future__ import annotations

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


def sample_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: the first token whose cumulative mass exceeds u * total. probs [..., V], u [...]."""
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def request_generator(seed: int | None, salt: int = 0) -> torch.Generator:
    """A CPU generator for one request: seeded deterministically, or from OS entropy when seed is None."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * 1_000_003 + salt) % (2**63))
    return g
