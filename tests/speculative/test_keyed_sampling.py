"""Sampling keyed by position: a seeded request emits the same tokens whatever decodes it (target-only, any
chain depth, a draft tree, adaptive switches between them, steps launched ahead), however its prompt is
chunked and whatever shares its batch; drafts still get accepted while sampling."""

from __future__ import annotations

from typing import Any

import pytest

from mtpserve.cluster.engine.llm_engine import LLMEngine
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine
from tests.speculative.test_adaptive import adaptive_engine, forced_policy, run
from tests.speculative.test_adaptive_trees import TREE, forced, tree_adaptive_engine

SAMPLED = [
    {"max_tokens": 40, "temperature": 0.8, "seed": 11},
    {"max_tokens": 9, "temperature": 1.0, "top_k": 20, "seed": 12},
    {"max_tokens": 18, "temperature": 0.7, "top_p": 0.9, "seed": 13},
    {"max_tokens": 27, "temperature": 1.2, "seed": 14},
]


def prompts_and_reference() -> tuple[list[list[int]], dict[str, list[int]]]:
    """Four prompts and their tokens under target-only decoding, each request alone in its engine."""
    args, w = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [17, 5, 11, 23], seed=4)
    alone: dict[str, list[int]] = {}
    for i, (p, params) in enumerate(zip(prompts, SAMPLED, strict=True)):
        got = run(tiny_engine(args, w), [p], [params])
        alone[f"r{i}"] = got["r0"]
    return prompts, alone


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], dict[str, list[int]]]:
    """The prompts and each request's target-only tokens alone."""
    return prompts_and_reference()


def test_target_only_tokens_do_not_depend_on_the_batch_or_the_chunking(reference: Any) -> None:
    """Together in one batch, with 4-token prompt chunks: each request's tokens equal its tokens alone."""
    prompts, alone = reference
    args, w = mimic_target()
    eng = tiny_engine(args, w, scheduler={"chunk_size": 4, "max_num_batched_tokens": 16})
    assert run(eng, prompts, SAMPLED) == alone


@pytest.mark.parametrize("k", [1, 3])
def test_fixed_chains_sample_the_target_only_tokens(reference: Any, k: int) -> None:
    """A fixed chain of k drafts emits each seeded request's target-only tokens, and accepts drafts."""
    prompts, alone = reference
    args, w = mimic_target()
    eng = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": k})
    assert run(eng, prompts, SAMPLED) == alone
    assert eng.totals.accepted > 0


@pytest.mark.parametrize("fused,overlap", [(False, False), (True, False), (True, True)])
def test_adaptive_chains_sample_the_target_only_tokens(reference: Any, fused: bool, overlap: bool) -> None:
    """Depths 0..3 switching with the batch (eager, the fixed-buffer depth steps, steps launched ahead): each
    seeded request's tokens equal its target-only tokens alone."""
    prompts, alone = reference
    eng = adaptive_engine(forced_policy({1: 3, 2: 1, 4: 2, 8: 0}), fused, overlap)
    assert run(eng, prompts, SAMPLED) == alone
    used = eng.scheduler.depth.steps_per_depth  # type: ignore[union-attr]
    assert sum(1 for u in used[1:] if u > 0) >= 2, used
    assert eng.totals.accepted > 0


@pytest.mark.parametrize("fused,overlap", [(False, False), (True, False), (True, True)])
def test_switching_trees_and_chains_sample_the_target_only_tokens(reference: Any, fused: bool, overlap: bool) -> None:
    """The draft tree at one and four requests, depth 1 at two (eager, fixed-buffer steps, steps launched
    ahead): each seeded request's tokens equal its target-only tokens alone, and trees accept drafts."""
    prompts, alone = reference
    eng: LLMEngine = tree_adaptive_engine(fused, overlap)
    policy = forced(eng, {1: TREE, 2: 1, 4: TREE, 8: 3})
    assert run(eng, prompts, SAMPLED) == alone
    assert policy.tree_steps > 5 and sum(policy.steps_per_depth[1:]) > 0, policy.step_counts()
    assert eng.totals.accepted > 0


def test_a_different_seed_gives_different_tokens(reference: Any) -> None:
    """The check can fail: the same requests with other seeds emit other tokens."""
    prompts, alone = reference
    args, w = mimic_target()
    other = [{**p, "seed": p["seed"] + 100} for p in SAMPLED]
    assert run(tiny_engine(args, w), prompts, other) != alone
