"""Draft-KV invariance across preemption and resume, mid-prompt and mid-generation."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from tests.helpers.tiny import draft_kv, mimic_head, mimic_target, random_prompts, tiny_engine

L = 29


def engine(chunk: int, caching: bool = False) -> LLMEngine:
    args, w = mimic_target()
    sched = {"chunk_size": chunk, "max_num_batched_tokens": 64, "prefix_caching": caching}
    return tiny_engine(args, w, mimic_head(args, w), scheduler=sched)


def prompt() -> list[int]:
    return random_prompts(1, 96, [L], seed=5)[0]


@pytest.mark.parametrize("caching", [False, True], ids=["recompute", "cached"])
def test_preempt_mid_prompt_then_resume(caching: bool) -> None:
    ref = engine(L)
    rid = ref.add_request(prompt(), {"max_tokens": 20})
    while ref.scheduler.requests[rid].in_context:
        ref.step()
    want = draft_kv(ref, rid, L)

    eng = engine(5, caching)
    rid = eng.add_request(prompt(), {"max_tokens": 20})
    req = eng.scheduler.requests[rid]
    eng.step()
    eng.step()
    assert req.in_context and 0 < req.num_computed_tokens < L
    eng.scheduler.preempt(req)
    assert req.block_ids == []
    while req.in_context:
        eng.step()
    assert eng.scheduler.prefix_hit_tokens == (8 if caching else 0), "10 tokens computed: block 0 is reused"
    assert req.num_preemptions == 1
    assert (draft_kv(eng, rid, L) - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("caching", [False, True], ids=["recompute", "cached"])
def test_preempt_mid_generation_then_resume(caching: bool) -> None:
    eng = engine(6, caching)
    rid = eng.add_request(prompt(), {"max_tokens": 40})
    req = eng.scheduler.requests[rid]
    while len(req.output_token_ids) < 12:
        eng.step()
    n = req.num_tokens
    eng.scheduler.preempt(req)
    hits = eng.scheduler.prefix_hit_tokens
    while req.in_context:
        eng.step()
    assert eng.scheduler.prefix_hit_tokens - hits == (8 * ((n - 1) // 8) if caching else 0)
    assert req.num_computed_tokens == n
    resumed = draft_kv(eng, rid, n)
    tokens_b = list(req.output_token_ids)
    while eng.has_unfinished():
        eng.step()

    ref = engine(6)
    rid = ref.add_request(prompt(), {"max_tokens": 40})
    r = ref.scheduler.requests[rid]
    while r.num_computed_tokens < n:
        ref.step()
    want = draft_kv(ref, rid, n)
    assert r.output_token_ids[: len(tokens_b)] == tokens_b
    assert (resumed - want).abs().max().item() <= 1e-5
    assert torch.isfinite(resumed).all()
