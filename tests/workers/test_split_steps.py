"""A step that mixes one prompt chunk with generation rows runs as two fixed-shape steps (the captured
prefill step, then the captured generation step), eagerly on CPU over the buffers CUDA captures: tokens,
acceptance and KV blocks equal the eager mixed step's."""

from __future__ import annotations

from typing import Any

import pytest

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.messages import StepPlan
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.prefill_step import CapturedPrefill
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine, with_steps

CHUNK = 20


def fixed_shape_steps(eng: LLMEngine, k: int) -> list[tuple[int, int, int]]:
    """Give the runner the prefill step and the generation step of its kind (eager over fixed buffers), arrivals
    joining in steps run in turn; returns a log of (generation rows, the first chunk's rows, prompt chunks) for
    every split step."""
    runner = eng.target
    model, cache = runner.model, runner.cache  # type: ignore[attr-defined]
    prefill = CapturedPrefill(
        model, cache, eng.draft, k, max_tokens=CHUNK, max_blocks=16, device="cpu", use_graphs=False
    )  # type: ignore[arg-type]
    if k:
        chain = FusedSpecStep(model, cache, eng.draft, k, max_batch=8, max_blocks=16, device="cpu", use_graphs=False)  # type: ignore[arg-type]
        runner = with_steps(eng, prefill=prefill, chain=chain)
    else:
        target = UniformTargetStep(model, cache, 1, max_batch=8, max_blocks=16, device="cpu", use_graphs=False)
        runner = with_steps(eng, prefill=prefill, target=target)
    eng.scheduler.join_ahead = False  # arrivals join in split steps run in turn (joining ahead: test_joined_steps)
    log: list[tuple[int, int, int]] = []
    orig = runner.run_split  # type: ignore[attr-defined]

    def spy(plan: StepPlan, *rest: Any) -> Any:
        ctx = [s for s in plan.seqs if s.is_context]
        log.append((len(plan.seqs) - len(ctx), len(ctx[0].token_ids), len(ctx)))
        return orig(plan, *rest)

    runner.run_split = spy  # type: ignore[attr-defined]
    return log


def staggered(
    eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]], together: int = 1
) -> list[list[int]]:
    """Requests that arrive `together` at a time every three steps, so prompts meet others' generation rows (and
    each other); tokens per request."""
    out: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(zip(prompts, params, strict=True))
    step = 0
    while pending or eng.has_unfinished():
        for _ in range(together if step % 3 == 0 else 0):
            if not pending:
                break
            p, q = pending.pop(0)
            ids.append(eng.add_request(p, q))
            out[ids[-1]] = []
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return [out[r] for r in ids]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_mixed_steps_split_into_fixed_shape_steps_match_eager(k: int) -> None:
    """Greedy prompts of several lengths (padded, non-final and final chunks) arrive while others decode:
    the split steps give the eager mixed steps' tokens and acceptance, and return every block."""
    args, w = mimic_target(seed=2)
    head = mimic_head(args, w) if k else None
    spec = {"num_draft_tokens": max(k, 1)}
    sched = {"chunk_size": CHUNK, "max_num_batched_tokens": 64}
    prompts = random_prompts(6, args.vocab_size, [25, 3, 45, 11, 17, 2], seed=4)
    params = [{"max_tokens": 14}] * len(prompts)
    ref = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    want = staggered(ref, prompts, params)
    eng = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    log = fixed_shape_steps(eng, k)
    assert staggered(eng, prompts, params) == want
    assert log and any(g > 1 for g, _, _ in log), log
    assert (eng.totals.accepted, eng.totals.drafted) == (ref.totals.accepted, ref.totals.drafted)
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_sampling_rows_beside_a_greedy_prompt_keep_their_draws() -> None:
    """Generation rows that sample (seeded) beside a greedy prompt chunk draw the same numbers in the split
    step as in the eager mixed step; a sampling prompt chunk keeps the eager path."""
    args, w = mimic_target(seed=5)
    head = mimic_head(args, w)
    sched = {"chunk_size": CHUNK}
    prompts = random_prompts(5, args.vocab_size, [9, 30, 4, 22, 13], seed=6)
    params: list[dict[str, Any]] = [
        {"max_tokens": 12, "temperature": 0.9, "seed": 1},
        {"max_tokens": 12},
        {"max_tokens": 12, "temperature": 1.1, "top_k": 5, "seed": 2},
        {"max_tokens": 12},
        {"max_tokens": 12, "temperature": 0.8, "seed": 3},
    ]
    want = staggered(tiny_engine(args, w, head, scheduler=sched), prompts, params)
    eng = tiny_engine(args, w, head, scheduler=sched)
    log = fixed_shape_steps(eng, 3)
    assert staggered(eng, prompts, params) == want
    assert log  # the greedy prompts met sampling rows in split steps


@pytest.mark.parametrize("k", [0, 3])
def test_several_prompt_chunks_in_a_step_share_the_prefill_step_and_match_eager(k: int) -> None:
    """Prompts arriving three at a time meet each other and others' generation rows: the step's chunks run
    through the prefill step together, the generation rows through theirs, and tokens, acceptance and blocks
    equal the eager steps'."""
    args, w = mimic_target(seed=3)
    head = mimic_head(args, w) if k else None
    spec = {"num_draft_tokens": max(k, 1)}
    sched = {"chunk_size": CHUNK, "max_num_batched_tokens": 80}
    prompts = random_prompts(9, args.vocab_size, [25, 3, 11, 17, 2, 30, 9, 14, 6], seed=7)
    params = [{"max_tokens": 10}] * len(prompts)
    ref = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    want = staggered(ref, prompts, params, together=3)
    eng = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    log = fixed_shape_steps(eng, k)
    assert staggered(eng, prompts, params, together=3) == want
    assert any(n >= 2 and g >= 1 for g, _, n in log), log  # several chunks beside generation rows
    assert any(n >= 2 and g == 0 for g, _, n in log), log  # several chunks alone
    assert (eng.totals.accepted, eng.totals.drafted) == (ref.totals.accepted, ref.totals.drafted)
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("k", [0, 3])
def test_a_burst_of_prompt_chunks_shares_replays_and_matches_eager(k: int) -> None:
    """Prompts arriving seven at a time, some sampling (seeded), meet each other and others' generation rows:
    several chunks go into one replay of the prefill step (several replays where their rows do not fit one),
    queued with the generation step before anything is read; tokens, acceptance and blocks equal the eager
    steps'."""
    args, w = mimic_target(seed=8)
    head = mimic_head(args, w) if k else None
    spec = {"num_draft_tokens": max(k, 1)}
    sched = {"chunk_size": CHUNK, "max_num_batched_tokens": 96}
    lengths = [5, 23, 9, 2, 31, 4, 6, 11, 1, 8, 3, 25, 10, 2]  # some longer than a chunk
    prompts = random_prompts(len(lengths), args.vocab_size, lengths, seed=9)
    params: list[dict[str, Any]] = [
        {"max_tokens": 9, "temperature": 0.9, "seed": i} if i % 3 == 0 else {"max_tokens": 9}
        for i in range(len(prompts))
    ]
    ref = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    want = staggered(ref, prompts, params, together=7)
    eng = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    log = fixed_shape_steps(eng, k)
    prefill = eng.target.steps.prefill  # type: ignore[attr-defined]
    replays: list[int] = []
    launch = prefill.launch

    def spy(plan: StepPlan, *rest: Any) -> Any:
        replays.append(len(plan.seqs))
        return launch(plan, *rest)

    prefill.launch = spy
    assert staggered(eng, prompts, params, together=7) == want
    assert max(replays) >= 3, replays  # several chunks in one replay
    assert len(replays) > len(log), (log, replays)  # a step whose chunks took several replays
    assert any(n >= 2 and g >= 1 for g, _, n in log), log  # chunks beside generation rows
    assert (eng.totals.accepted, eng.totals.drafted) == (ref.totals.accepted, ref.totals.drafted)
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks
