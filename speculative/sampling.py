"""Turning logits into token distributions (temperature, top-k, top-p) and sampling them from uniforms."""

from __future__ import annotations

import torch


def processed_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row token distribution [N, V]; rows with temperature 0 become one-hot at the argmax.

    logits [N, V] float; temperature [N]; top_k [N] (0 = off); top_p [N] in (0, 1].
    """
    v = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(v, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    drop = ranks >= k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
    drop |= before >= top_p[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
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
