"""Sampling: seeded reproducibility, top-k / top-p support, stop conditions."""

from __future__ import annotations

import torch

from mtpserve.speculative.sampling import processed_probs, sample_at_threshold
from tests.helpers.tiny import random_prompts, tiny_args, tiny_engine, tiny_weights


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    one = torch.ones(1)
    k2 = processed_probs(logits, one, torch.tensor([2]), one)
    assert torch.allclose(k2, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    p07 = processed_probs(logits, one, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(p07, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    full = processed_probs(logits, one, torch.tensor([0]), one)
    assert torch.allclose(full, torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    greedy = processed_probs(logits, torch.zeros(1), torch.tensor([0]), one)
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_inverse_cdf_sampling_frequencies() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(40000, 4)
    u = torch.rand(40000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_at_threshold(probs, u), minlength=4).float() / 40000
    assert counts[1] == 0
    assert torch.allclose(counts, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.01)


def test_seeded_sampling_reproducible_and_seed_sensitive() -> None:
    args = tiny_args()
    w = tiny_weights(args)
    p = random_prompts(2, args.vocab_size, [9, 14], seed=4)
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 123}
    a = [c.token_ids for c in tiny_engine(args, w).generate(p, params)]
    b = [c.token_ids for c in tiny_engine(args, w, scheduler={"chunk_size": 4}).generate(p, params)]
    c = [c.token_ids for c in tiny_engine(args, w).generate(p, {**params, "seed": 124})]
    assert a == b
    assert a != c


def test_stop_token_and_eos_and_length() -> None:
    args = tiny_args(eos_token_id=7)
    w = tiny_weights(args)
    p = random_prompts(1, args.vocab_size, [10], seed=1)
    free = tiny_engine(args, w).generate(p, {"max_tokens": 40, "ignore_eos": True})[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    stopped = tiny_engine(args, w).generate(p, {"max_tokens": 40, "ignore_eos": True, "stop_token_ids": [stop_tok]})
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids == free.token_ids[: first + 1]
    if 7 in free.token_ids:
        eos = tiny_engine(args, w).generate(p, {"max_tokens": 40})[0]
        assert eos.finish_reason == "stop" and eos.token_ids[-1] == 7


def test_temperature_only_mode_skips_filtering_and_matches_the_sorted_path() -> None:
    """Without top-k/top-p the unsorted path gives the sorted path's distribution; the mode picks the
    cheapest variant that serves every request of a step."""
    from types import SimpleNamespace

    from mtpserve.speculative.sampling import SamplingMode, sampling_mode

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.7, 0.0, 1.3])
    off_k, off_p = torch.zeros(3, dtype=torch.long), torch.ones(3)
    fast = processed_probs(logits, t, off_k, off_p, filtered=False)
    assert torch.allclose(fast, processed_probs(logits, t, off_k, off_p), atol=1e-6)
    wide = torch.randn(2, 49152, generator=torch.Generator().manual_seed(2)) * 4  # the cumulative sum reaches 1.0
    kept = processed_probs(wide, torch.tensor([0.7, 0.7]), torch.zeros(2, dtype=torch.long), torch.ones(2)) > 0
    assert torch.equal(kept, processed_probs(wide, torch.tensor([0.7, 0.7]), off_k[:2], off_p[:2], filtered=False) > 0)
    assert fast[1].tolist() == torch.nn.functional.one_hot(logits[1].argmax(), 50).float().tolist()

    def req(temperature: float, top_k: int = 0, top_p: float = 1.0) -> SimpleNamespace:
        return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p)

    assert sampling_mode([req(0.0), req(0.0, top_k=5)]) is SamplingMode.GREEDY
    assert sampling_mode([req(0.0), req(0.8)]) is SamplingMode.TEMPERATURE
    assert sampling_mode([req(0.8), req(0.5, top_p=0.9)]) is SamplingMode.FILTERED
    assert sampling_mode([req(0.8), req(0.5, top_k=40)]) is SamplingMode.FILTERED
