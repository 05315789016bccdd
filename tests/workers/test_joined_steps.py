"""Arrivals that join launched steps: their whole prompts ride a step launched ahead (the captured prefill step
beside the captured generation step), and the step after reads their first tokens on the device. Run eagerly on
CPU over the fixed buffers CUDA captures; the reference is the same engine without launched steps."""

from __future__ import annotations

from typing import Any

import pytest

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.messages import StepPlan
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.prefill_step import CapturedPrefill
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine, with_steps

CHUNK = 24


def engine(k: int, ahead: int = 1, overlap: bool = True, prefill_rows: int = 64, **sched: Any) -> LLMEngine:
    """A tiny engine, target-only (k = 0) or with a K-draft chain, on the fixed-buffer prefill and generation
    steps (`ahead` steps launched when `overlap`); prefill replays of up to `prefill_rows` rows."""
    args, w = mimic_target(seed=2)
    head = mimic_head(args, w) if k else None
    spec = {"num_draft_tokens": max(k, 1)}
    scheduler = {"chunk_size": CHUNK, "max_num_batched_tokens": 128, "admit_wait_ms": 0.0, **sched}
    model = {"overlap_steps": overlap, "steps_ahead": ahead}
    eng = tiny_engine(args, w, head, speculative=spec, scheduler=scheduler, model=model)
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    m, cache = runner.model, runner.cache
    prefill = CapturedPrefill(
        m, cache, eng.draft, k, max_tokens=prefill_rows, max_blocks=16, device="cpu", use_graphs=False
    )  # type: ignore[arg-type]
    if k:
        chain = FusedSpecStep(m, cache, eng.draft, k, max_batch=8, max_blocks=16, device="cpu", use_graphs=False)  # type: ignore[arg-type]
        with_steps(eng, prefill=prefill, chain=chain)
    else:
        target = UniformTargetStep(m, cache, 1, max_batch=8, max_blocks=16, device="cpu", use_graphs=False)
        with_steps(eng, prefill=prefill, target=target)
    return eng


def watch(eng: LLMEngine) -> dict[str, list[Any]]:
    """Records the plans launched with prompt chunks (`joined`) and every plan run in turn (`in_turn`)."""
    seen: dict[str, list[Any]] = {"joined": [], "in_turn": []}
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    launch, execute = runner.launch, runner.execute

    def spy_launch(plan: StepPlan, after: Any = None) -> Any:
        launched = launch(plan, after)
        if launched is not None and plan.seqs[0].is_context:
            seen["joined"].append((plan, after is not None))
        return launched

    def spy_execute(plan: StepPlan) -> Any:
        seen["in_turn"].append(plan)
        return execute(plan)

    runner.launch = spy_launch  # type: ignore[method-assign]
    runner.execute = spy_execute  # type: ignore[method-assign]
    return seen


def arrivals(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]], at: list[int]) -> list[Any]:
    """Request i added before step at[i] (from 0) while the others decode; each request's tokens and finish
    reason, in arrival order."""
    out: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    ids: list[str] = []
    step = 0
    while len(ids) < len(prompts) or eng.has_unfinished():
        for i in range(len(ids), len(prompts)):
            if at[i] <= step:
                ids.append(eng.add_request(prompts[i], params[i]))
                out[ids[-1]] = []
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
            reasons[o.request_id] = o.finish_reason
        step += 1
    return [(out[r], reasons[r]) for r in ids]


PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 20},
    {"max_tokens": 14, "temperature": 0.9, "seed": 4},
    {"max_tokens": 17},
    {"max_tokens": 12, "temperature": 1.0, "top_k": 8, "seed": 9},
    {"max_tokens": 2},  # ends in the step after its prompt
    {"max_tokens": 16},
]


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("k", [0, 3])
def test_arrivals_join_launched_steps_with_the_tokens_of_steps_run_in_turn(k: int, ahead: int) -> None:
    """Greedy and sampling requests arriving while others decode, one ending right after its prompt: each joins
    in a launched step (after the first, launched from a step still on the device), no step runs in turn, and
    tokens, finish reasons, acceptance and freed blocks equal those without launching."""
    args, _ = mimic_target(seed=2)
    prompts = random_prompts(len(PARAMS), args.vocab_size, [9, 21, 5, 14, 11, 24], seed=7)
    ref = engine(k, overlap=False)
    at = [0, 0, 3, 6, 9, 12]
    want = arrivals(ref, prompts, PARAMS, at)
    eng = engine(k, ahead)
    seen = watch(eng)
    got = arrivals(eng, prompts, PARAMS, at)
    assert got == want
    assert [len(t) for t, _ in got] == [p["max_tokens"] for p in PARAMS]
    assert (eng.totals.drafted, eng.totals.accepted) == (ref.totals.drafted, ref.totals.accepted)
    if k:
        assert ref.totals.accepted > 0, "the mimic head gets drafts accepted"
    joined = [(len([s for s in p.seqs if s.is_context]), chained) for p, chained in seen["joined"]]
    assert sum(n for n, _ in joined) == len(PARAMS), f"every prompt joined in a launched step: {joined}"
    # the first two come with the first step; one may come as the queue empties (a request surely ending)
    assert sum(chained for _, chained in joined) >= len(PARAMS) - 3, joined
    assert seen["in_turn"] == [], "no step ran in turn"
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_prompts_the_prefill_replays_cannot_take_join_in_turn() -> None:
    """A prompt longer than a chunk, and five arriving together that need more prefill replays than a step takes,
    join the old way (the launched steps read, then steps run in turn); the plan the runner refused gives its
    admitted requests back to the queue, in order. Two arriving together that need two replays join ahead.
    Tokens equal those without launching, and every block comes back."""
    args, _ = mimic_target(seed=2)
    lengths = [6, 8, 40, 20, 20, 20, 20, 20, 20, 20]
    prompts = random_prompts(len(lengths), args.vocab_size, lengths, seed=3)
    params: list[dict[str, Any]] = [{"max_tokens": 16}] * len(lengths)
    at = [0, 0, 2, 6, 6, 6, 6, 6, 30, 30]
    ref = engine(3, overlap=False, prefill_rows=32)
    want = arrivals(ref, prompts, params, at)
    eng = engine(3, prefill_rows=32)
    seen = watch(eng)
    got = arrivals(eng, prompts, params, at)
    assert got == want
    turn_chunks = [[(len(s.token_ids), s.is_final_chunk) for s in p.seqs if s.is_context] for p in seen["in_turn"]]
    assert [(24, False)] in turn_chunks, f"the 40-token prompt's first chunk ran in turn: {turn_chunks}"
    assert [(20, True)] * 5 in turn_chunks, "the five 20-token prompts (five replays) joined in turn together"
    joined = [[len(s.token_ids) for s in p.seqs if s.is_context] for p, _ in seen["joined"]]
    assert [20, 20] in joined, f"two 20-token prompts (two replays of 32 rows) joined ahead: {joined}"
    assert eng.scheduler.num_waiting == 0
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_the_step_after_a_joined_prompt_reads_its_first_token_at_its_end() -> None:
    """Planned ahead of a step that holds a request's whole prompt, the next step points that request at the
    prompt's row and starts it at the prompt's end; the decoding request keeps its row and position lead."""
    eng = engine(0)
    short, later = random_prompts(2, eng.args.vocab_size, [7, 13], seed=5)
    eng.add_request(short, {"max_tokens": 30}, request_id="a")
    eng.step()  # 'a' joins in the first step
    eng.step()
    eng.add_request(later, {"max_tokens": 30}, request_id="b")
    sched = eng.scheduler
    pending = eng._launched[-1].plan
    joined = sched.plan_ahead(pending, unapplied=len(eng._launched))
    assert joined is not None and [s.request_id for s in joined.seqs] == ["b", "a"]
    chunk = joined.seqs[0]
    assert chunk.is_context and chunk.is_final_chunk and chunk.token_ids == later and chunk.start == 0
    nxt = sched.plan_ahead(joined, unapplied=len(eng._launched) + 1)
    assert nxt is not None
    lead = sched.requests["a"].num_computed_tokens + len(eng._launched) + 1  # a token for each unapplied step
    assert [(s.request_id, s.token_ids[0], s.start) for s in nxt.seqs] == [("b", 0, 13), ("a", 1, lead)]
    sched.cancel_ahead(nxt)
    sched.cancel_ahead(joined)
    assert [r.request_id for r in sched.waiting] == ["b"] and sched.requests["b"].block_ids == []
