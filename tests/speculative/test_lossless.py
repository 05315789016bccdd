"""Greedy speculative decoding is token-identical to target-only greedy decoding."""

from __future__ import annotations

import pytest

from tests.helpers.smol import CHAT_PROMPTS, random_smollm2_head, smollm2_engine
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("chunk", [4, 512])
def test_tiny_lossless_batched(k: int, chunk: int) -> None:
    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=k)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]
    eng = tiny_engine(
        args,
        w,
        mimic_head(args, w),
        scheduler={"chunk_size": chunk, "max_num_batched_tokens": 48},
        speculative={"num_draft_tokens": k},
    )
    out = eng.generate(prompts, {"max_tokens": 30})
    assert [c.token_ids for c in out] == ref
    s = eng.totals
    assert s.drafted == k * s.verify_steps
    assert 0 < s.accepted < s.drafted, "both the accept and the reject paths must be exercised"
    assert s.acceptance_length > 1.3


def test_tiny_lossless_with_stop_inside_accepted_drafts() -> None:
    args, w = mimic_target()
    prompts = random_prompts(3, args.vocab_size, [12, 5, 30], seed=21)
    ref = tiny_engine(args, w).generate(prompts, {"max_tokens": 30})
    stop = ref[0].token_ids[10]
    ref_stop = tiny_engine(args, w).generate(prompts, {"max_tokens": 30, "stop_token_ids": [stop]})
    eng = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": 4})
    out = eng.generate(prompts, {"max_tokens": 30, "stop_token_ids": [stop]})
    assert [c.token_ids for c in out] == [c.token_ids for c in ref_stop]
    assert [c.finish_reason for c in out] == [c.finish_reason for c in ref_stop]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_smollm2_lossless(k: int) -> None:
    base = smollm2_engine()
    prompts = [base.encode_prompt(p) for p in CHAT_PROMPTS[:3]]
    ref = [c.token_ids for c in base.generate(prompts, {"max_tokens": 24})]
    for chunk in (7, 512):
        eng = smollm2_engine(
            random_smollm2_head(seed=k),
            scheduler={"chunk_size": chunk, "max_num_batched_tokens": 256},
            speculative={"num_draft_tokens": k},
        )
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 24})] == ref


@pytest.mark.parametrize("spec", [{"num_draft_tokens": 3}, {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3}])
def test_drafting_up_to_the_models_last_position(spec: dict[str, int]) -> None:
    """Served at its full max_position_embeddings, a request's last steps draft rows past the model's last
    position (their tokens are cut at the limit): target-only tokens, finish reason 'length'. The RoPE
    tables hold those rows (they used to index past the table)."""
    import dataclasses

    args, w = mimic_target()
    args = dataclasses.replace(args, max_position_embeddings=48)
    prompts = random_prompts(2, args.vocab_size, [30, 40], seed=3)
    params = {"max_tokens": 100, "ignore_eos": True}
    want = [(c.token_ids, c.finish_reason) for c in tiny_engine(args, w).generate(prompts, params)]
    got = tiny_engine(args, w, mimic_head(args, w), speculative=spec).generate(prompts, params)
    assert [(c.token_ids, c.finish_reason) for c in got] == want
    assert {r for _, r in want} == {"length"} and len(want[1][0]) == 8
