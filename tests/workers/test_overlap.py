"""Overlapped target-only decoding: the next step is queued before this step's tokens are read, its input
tokens gathered from the previous step's output on the device. Run eagerly on CPU over the fixed buffers
that CUDA captures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.runner import TargetRunner
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine, with_steps, with_uniform

PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 24},
    {"max_tokens": 9, "temperature": 0.8, "seed": 3},
    {"max_tokens": 30, "temperature": 1.0, "top_k": 20, "seed": 5},
    {"max_tokens": 16},
]


def drive(
    eng: LLMEngine,
    prompts: list[list[int]],
    params: list[dict[str, Any]],
    late_at: int | None = 4,
    abort_at: int = 12,
) -> dict[str, Any]:
    """Requests r0-r2 from the start, r3 after `late_at` steps (None: from the start too), r2 aborted after
    `abort_at`; per request the tokens and finish reason, the drafted and accepted counts, the acceptance rate
    and the KV blocks still held at the end."""
    for i in range(3 if late_at is not None else 4):
        eng.add_request(prompts[i], params[i], request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            reasons[o.request_id] = o.finish_reason
        steps += 1
        if steps == late_at:
            eng.add_request(prompts[3], params[3], request_id="r3")
        if steps == abort_at:
            eng.abort("r2")
    blocks = eng.scheduler.blocks
    return {
        "tokens": tokens,
        "reasons": reasons,
        "counts": (eng.totals.drafted, eng.totals.accepted),
        "acceptance": eng.totals.accepted / max(eng.totals.drafted, 1),
        "blocks_held": blocks.num_blocks - blocks.num_free,
    }


def overlap_engine(overlap: bool, k: int = 0, ahead: int = 1) -> tuple[LLMEngine, list[int]]:
    """A tiny engine with the fixed-buffer step: target-only (k = 0) or speculative with the fused step and
    a head that mimics the target, `ahead` steps launched; records which launches read their inputs from the
    previous step."""
    args, w = mimic_target()
    if k:
        model = {"overlap_steps": overlap, "overlap_speculative": overlap, "steps_ahead": ahead}
        eng = tiny_engine(args, w, mimic_head(args, w), model=model, speculative={"num_draft_tokens": k})
        runner = eng.target
        assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleChain)
        with_steps(
            eng,
            chain=FusedSpecStep(
                runner.model, runner.cache, eng.draft, k, max_batch=8, max_blocks=12, device="cpu", use_graphs=False
            ),
        )
    else:
        eng = tiny_engine(args, w, model={"overlap_steps": overlap, "steps_ahead": ahead})
        with_uniform(eng, 0)
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    chained: list[int] = []
    launch = runner.launch

    def spy(plan, after=None):  # type: ignore[no-untyped-def]
        launched = launch(plan, after)
        if launched is not None:
            chained.append(int(after is not None))
        return launched

    runner.launch = spy  # type: ignore[method-assign]
    return eng, chained


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("k", [0, 3])
def test_overlapped_decoding_emits_the_same_tokens(k: int, ahead: int) -> None:
    """Greedy and sampling requests, a stop token, a late arrival and an abort: the same tokens, finish
    reasons and acceptance with and without overlap (one or two steps launched ahead), target-only (k = 0) and
    speculative, most steps launched ahead, and every KV block returned."""
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [21, 5, 13, 9], seed=11)
    params = [dict(p) for p in PARAMS]
    probe, _ = overlap_engine(False, k)
    first = probe.generate(prompts[:1], params[0])[0].token_ids
    params[0]["stop_token_ids"] = [first[6]]  # request 0 stops on a token it emits part-way
    ref_engine, ref_chained = overlap_engine(False, k)
    want = drive(ref_engine, prompts, params)
    eng, chained = overlap_engine(True, k, ahead)
    assert eng.steps_ahead == ahead
    got = drive(eng, prompts, params)
    assert got == want
    assert (eng.totals.drafted, eng.totals.accepted) == (ref_engine.totals.drafted, ref_engine.totals.accepted)
    if k:
        assert want["acceptance"] > 0, "the mimic head gets drafts accepted"
    assert want["reasons"] == {"r0": "stop", "r1": "length", "r2": None, "r3": "length"}  # r2 was aborted
    assert 0 < len(want["tokens"]["r2"]) < 30
    assert len(want["tokens"]["r0"]) <= 7 and want["tokens"]["r0"][-1] == first[6]
    assert want["blocks_held"] == 0 and got["blocks_held"] == 0
    assert ref_chained == [], "without overlap nothing is launched ahead"
    assert eng.drain() == [], "a step launched before the abort is read only now; it brings nothing"
    assert ref_engine.steps_launched == 0 and eng.steps_launched == len(chained), "each launched step is counted"
    least = 15 if k == 0 else 5  # speculative requests finish in fewer, longer steps
    assert sum(chained) >= least and sum(chained) > len(chained) // 2, f"most steps must be launched ahead: {chained}"


@pytest.mark.parametrize("ahead", [1, 2])
def test_speculative_overlap_with_poor_acceptance_keeps_positions_exact(ahead: int) -> None:
    """An untrained head (nearly nothing accepted) over long generations near max_model_len, one or two steps
    launched ahead: each is planned from the request's real position plus the most the steps before it can
    accept (the device then takes the real position from the previous step's results), so blocks grow at
    the real rate, the captured tables always fit, and the tokens match the sequential path."""
    args, w = mimic_target()
    head = MTPEagleHead(args)
    head.init_random(seed=1)
    k, max_len = 3, 96
    prompts = random_prompts(3, args.vocab_size, [20, 9, 14], seed=6)

    def run(overlap: bool) -> tuple[list[list[int]], list[int], LLMEngine]:
        model = {"overlap_steps": overlap, "overlap_speculative": overlap, "max_model_len": max_len}
        model["steps_ahead"] = ahead
        eng = tiny_engine(args, w, head, model=model, speculative={"num_draft_tokens": k})
        runner = eng.target
        assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleChain)
        blocks = -(-(max_len + 2 * k) // eng.cfg.scheduler.block_size)  # as the engine sizes captured tables
        with_steps(
            eng,
            chain=FusedSpecStep(
                runner.model, runner.cache, eng.draft, k, max_batch=8, max_blocks=blocks, device="cpu", use_graphs=False
            ),
        )
        leads: list[int] = []
        plan_ahead = eng.scheduler.plan_ahead

        def spy(pending, unapplied=1):  # type: ignore[no-untyped-def]
            planned = plan_ahead(pending, unapplied)
            for sp in planned.seqs if planned is not None else []:
                leads.append(sp.start - eng.scheduler.requests[sp.request_id].num_computed_tokens)
            return planned

        eng.scheduler.plan_ahead = spy  # type: ignore[method-assign]
        out = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 70})]
        return out, leads, eng

    want, _, _ = run(False)
    got, leads, eng = run(True)
    assert got == want and all(len(t) > 40 for t in got)
    most = {(k + 1) * n for n in range(1, ahead + 1)}
    assert leads and set(leads) == most, "planned from the real position plus the most the steps before accept"
    assert eng.totals.accepted < eng.totals.drafted // 4, "the untrained head gets little accepted"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_speculative_overlap_can_be_turned_off() -> None:
    """With model.overlap_speculative off (on by default) speculative steps are read before the next is
    queued."""
    assert MTPServeConfig().model.overlap_speculative
    args, w = mimic_target()
    eng = tiny_engine(
        args, w, mimic_head(args, w), model={"overlap_speculative": False}, speculative={"num_draft_tokens": 2}
    )
    runner = eng.target
    assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleChain)
    assert eng.cfg.model.overlap_steps and not eng.cfg.model.overlap_speculative
    runner = with_steps(
        eng,
        chain=FusedSpecStep(
            runner.model, runner.cache, eng.draft, 2, max_batch=8, max_blocks=12, device="cpu", use_graphs=False
        ),
    )
    launches: list[object] = []
    launch = runner.launch
    runner.launch = lambda plan, after=None: launches.append(plan) or launch(plan, after)  # type: ignore[method-assign]
    eng.generate(random_prompts(2, args.vocab_size, [9, 4], seed=3), {"max_tokens": 12})
    assert launches == [] and runner.steps.chain.steps.greedy.replays == 0 and eng.totals.drafted > 0


def test_plan_ahead_keeps_rows_and_leaves_out_requests_that_end_by_length() -> None:
    """The step after a pending decode step points each request at its row, one position further, and
    leaves out a request whose pending token is its last."""
    args, w = mimic_target()
    eng = tiny_engine(args, w)
    prompts = random_prompts(2, args.vocab_size, [6, 4], seed=2)
    eng.add_request(prompts[0], {"max_tokens": 2}, request_id="short")
    eng.add_request(prompts[1], {"max_tokens": 20}, request_id="long")
    eng.step()  # prefill: both have one token
    pending = eng.scheduler.schedule()
    assert [len(s.token_ids) for s in pending.seqs] == [1, 1]
    ahead = eng.scheduler.plan_ahead(pending)
    assert ahead is not None
    assert [s.request_id for s in ahead.seqs] == ["long"], "'short' ends with its pending token"
    row = [s.request_id for s in pending.seqs].index("long")
    assert ahead.seqs[0].token_ids == [row] and ahead.seqs[0].start == pending.seqs[row].start + 1
    eng.add_request(prompts[0], {"max_tokens": 5}, request_id="late")
    assert eng.scheduler.plan_ahead(pending) is None, "a waiting request goes through schedule()"


def test_plan_ahead_keeps_speculative_requests_that_may_go_on() -> None:
    """With drafts, a request that the pending step only may finish (enough accepted drafts) stays in the
    next step, one that it surely finishes (its last token) is left out, and blocks cover K+1 tokens more."""
    args, w = mimic_target()
    k = 3
    eng = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": k})
    prompts = random_prompts(2, args.vocab_size, [6, 4], seed=2)
    eng.add_request(prompts[0], {"max_tokens": 3}, request_id="may")
    eng.add_request(prompts[1], {"max_tokens": 2}, request_id="ends")
    eng.step()  # prefill: one token each, drafts proposed
    pending = eng.scheduler.schedule()
    assert [len(s.token_ids) for s in pending.seqs] == [k + 1, k + 1]
    ahead = eng.scheduler.plan_ahead(pending)
    assert ahead is not None and [s.request_id for s in ahead.seqs] == ["may"]
    sp = ahead.seqs[0]
    req = eng.scheduler.requests["may"]
    assert sp.start == req.num_computed_tokens + k + 1 and len(sp.token_ids) == k + 1
    assert len(req.block_ids) * eng.cfg.scheduler.block_size >= eng.scheduler.slots_needed(sp.start + k + 1)


def test_device_token_gather_reads_the_previous_step() -> None:
    """With tokens_from, each row's input is the previous step's token at the row given in token_ids."""
    args, w = mimic_target()
    eng = tiny_engine(args, w)
    uniform = with_uniform(eng, 0)
    prompts = random_prompts(2, args.vocab_size, [7, 3], seed=4)
    for p in prompts:
        eng.add_request(p, {"max_tokens": 10})
    eng.step()
    plan = eng.scheduler.schedule()
    previous = torch.tensor([5, 3, 9])
    for sp, row in zip(plan.seqs, [2, 0], strict=True):
        sp.token_ids = [row]
    uniform.run(plan, 2, None, previous)
    assert uniform.buffers.input_ids[:2].tolist() == [9, 5]


def test_overlap_flags_map_onto_the_config() -> None:
    """`--no-overlap` turns every overlap off, `--no-overlap-speculative` only the speculative one; by
    default both are on."""
    import argparse

    from mtpserve.cluster.cli.common import add_engine_flags, config_from_args

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    default = config_from_args(p.parse_args([])).model
    spec_off = config_from_args(p.parse_args(["--no-overlap-speculative"])).model
    all_off = config_from_args(p.parse_args(["--no-overlap"])).model
    assert (default.overlap_steps, default.overlap_speculative) == (True, True)
    assert (spec_off.overlap_steps, spec_off.overlap_speculative) == (True, False)
    assert not all_off.overlap_steps
