"""DESIGN.md point 5: draft KV after any chunking equals one whole-prompt prefill (and `sampled` breaks it)."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from tests.helpers.smol import random_smollm2_head, smollm2_engine
from tests.helpers.tiny import draft_kv, mimic_head, mimic_target, random_prompts, tiny_engine

L = 37


def prefill_draft_kv(engine: LLMEngine, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Step until the prompt's final chunk ran; return draft KV [2, L, H, D] and the per-step guesses."""
    rid = engine.add_request(prompt, {"max_tokens": 8})
    req = engine.scheduler.requests[rid]
    while req.in_context:
        engine.step()
    return draft_kv(engine, rid, len(prompt)), req.output_token_ids


def tiny_run(chunk: int, source: str = "prompt", prompt: list[int] | None = None) -> torch.Tensor:
    args, w = mimic_target()
    eng = tiny_engine(
        args,
        w,
        mimic_head(args, w),
        scheduler={"chunk_size": chunk, "max_num_batched_tokens": 64},
        speculative={"lookahead_source": source},
    )
    return prefill_draft_kv(eng, prompt or random_prompts(1, args.vocab_size, [L], seed=11)[0])[0]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 16])
def test_tiny_draft_kv_is_chunk_invariant(chunk: int) -> None:
    whole = tiny_run(L)
    chunked = tiny_run(chunk)
    assert chunked.shape == whole.shape
    assert (chunked - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk", [3, 5])
def test_sampled_lookahead_corrupts_exactly_the_chunk_boundaries(chunk: int) -> None:
    prompt = random_prompts(1, 96, [L], seed=11)[0]
    whole = tiny_run(L, "sampled", prompt)
    buggy = tiny_run(chunk, "sampled", prompt)
    fixed = tiny_run(chunk, "prompt", prompt)
    assert (fixed - whole).abs().max().item() <= 1e-5
    row_diff = (buggy - whole).abs().amax(dim=(0, 2, 3))
    bad_rows = set(torch.nonzero(row_diff > 1e-5).flatten().tolist())
    boundaries = set(range(chunk - 1, L - 1, chunk))
    assert bad_rows, "the pre-fix behaviour must show up"
    assert bad_rows <= boundaries


@pytest.mark.slow
def test_smollm2_draft_kv_is_chunk_invariant() -> None:
    eng = smollm2_engine()
    prompt = eng.encode_prompt("Summarise the plot of Hamlet in a few sentences, naming the main characters.")
    n = len(prompt)
    head = random_smollm2_head()
    kv = {}
    for chunk in [1, 2, 3, 5, 16, n]:
        e = smollm2_engine(head, scheduler={"chunk_size": chunk, "max_num_batched_tokens": 128})
        kv[chunk] = prefill_draft_kv(e, prompt)[0]
    for chunk, value in kv.items():
        assert (value - kv[n]).abs().max().item() <= 1e-5, f"chunk {chunk}"
    e = smollm2_engine(
        head, scheduler={"chunk_size": 5, "max_num_batched_tokens": 128}, speculative={"lookahead_source": "sampled"}
    )
    buggy = prefill_draft_kv(e, prompt)[0]
    row_diff = (buggy - kv[n]).abs().amax(dim=(0, 2, 3))
    bad = set(torch.nonzero(row_diff > 1e-5).flatten().tolist())
    assert bad and bad <= set(range(4, n - 1, 5))
