"""Adaptive speculation: each step's draft depth from the batch size, the step costs and the running
acceptance; output unchanged at every depth, and depth 0 keeping the draft's KV current."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.workers.config import SpeculativeConfig
from mtpserve.workers.fused_step import FusedDepthSteps, FusedSpecStep
from mtpserve.workers.prefill_step import CapturedPrefill
from mtpserve.workers.runner import TargetRunner
from tests.helpers.tiny import (
    draft_kv,
    mimic_head,
    mimic_target,
    random_prompts,
    same_distribution_pvalue,
    tiny_engine,
    with_steps,
)

K = 3


def forced_policy(depth_by_bucket: dict[int, int], k: int = K) -> AdaptiveDepth:
    """A policy whose measured costs make one depth per bucket far cheaper than the others."""
    costs = StepCosts(sorted(depth_by_bucket), k, online=False)
    for bucket, want in depth_by_bucket.items():
        for depth in range(k + 1):
            costs.set(bucket, depth, 1.0 if depth == want else 100.0)
    return AdaptiveDepth(costs, AcceptanceTracker(k), explore_steps=0)


def adaptive_engine(
    policy: AdaptiveDepth | None, fused: bool = False, overlap: bool = False, prefill: bool = False
) -> LLMEngine:
    """A tiny speculative engine with adaptive depth (the mimic head gets drafts accepted); `policy` replaces
    the built one, `fused` runs generation steps through the fixed-buffer fused steps of every depth and
    `prefill` lone prompt chunks through the fixed-buffer prefill step (K drafts, cut to the step's depth)."""
    args, w = mimic_target()
    model = {"overlap_steps": overlap, "overlap_speculative": overlap}
    spec = {"num_draft_tokens": K, "adaptive": True}
    sched = {"chunk_size": 32, "max_num_batched_tokens": 64}
    eng = tiny_engine(args, w, mimic_head(args, w), model=model, speculative=spec, scheduler=sched)
    runner = eng.target
    assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleChain)
    assert runner.drafting
    if fused:
        steps = {
            d: FusedSpecStep(
                runner.model, runner.cache, eng.draft, d, max_batch=8, max_blocks=16, device="cpu", use_graphs=False
            )
            for d in range(K + 1)
        }
        runner = with_steps(eng, chain=FusedDepthSteps(steps))
    if prefill:
        prefill_step = CapturedPrefill(
            runner.model, runner.cache, eng.draft, K, max_tokens=32, max_blocks=16, device="cpu", use_graphs=False
        )
        runner = with_steps(eng, prefill=prefill_step)
    if policy is not None:
        eng.scheduler.depth = policy
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Every request to completion; tokens per request, and every KV block must come back."""
    ids = [eng.add_request(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id].extend(o.new_token_ids)
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks, "KV blocks leaked"
    return tokens


# ---- the policy ------------------------------------------------------------------------------------


def test_tracker_estimates_how_often_each_prefix_is_accepted() -> None:
    """Rates are the share of verify rows that accepted at least j drafts, over rows that drafted j; a
    shorter chain says nothing about the positions it did not draft."""
    tracker = AcceptanceTracker(3, halflife=1e9, prior_weight=1e-9)
    accepted = [0, 1, 3, 2, 1, 0, 3, 3, 1, 2] * 20
    for n in accepted:
        tracker.record(3, n)
    for _ in range(50):
        tracker.record(1, 1)  # depth-1 rows: position 1 only
    rows3 = len(accepted)
    want1 = (sum(n >= 1 for n in accepted) + 50) / (rows3 + 50)
    want = [want1] + [sum(n >= j for n in accepted) / rows3 for j in (2, 3)]
    assert tracker.rates() == pytest.approx(want)
    assert tracker.expected_tokens(2) == pytest.approx(1 + want[0] + want[1])


def test_tracker_follows_a_change_in_acceptance() -> None:
    """With a half-life of 32 rows, 200 rows that accept nothing bring the estimate near 0."""
    tracker = AcceptanceTracker(2, halflife=32)
    for _ in range(200):
        tracker.record(2, 2)
    assert tracker.rates()[1] > 0.95
    for _ in range(200):
        tracker.record(2, 0)
    assert tracker.rates()[0] < 0.05 and tracker.rates()[1] <= tracker.rates()[0]


def best_by_brute_force(costs: dict[int, list[float]], rates: list[float], bucket: int) -> int:
    """argmax over depths of (1 + sum of the first d rates) / cost."""
    scores = [(1 + sum(rates[:d])) / c for d, c in enumerate(costs[bucket])]
    return max(range(len(scores)), key=lambda d: scores[d])


@pytest.mark.parametrize("rates", [[0.8, 0.6, 0.4], [0.5, 0.25, 0.1], [0.05, 0.01, 0.0]])
def test_policy_picks_the_depth_with_most_tokens_per_second(rates: list[float]) -> None:
    """Small batches pay little for depth and large ones a lot: the chosen depth is the brute-force argmax
    of expected tokens per second in each bucket, and falls as acceptance falls."""
    table = {1: [1.0, 1.1, 1.2, 1.3], 8: [1.0, 1.3, 1.6, 1.9], 64: [1.0, 1.6, 2.2, 2.8]}
    costs = StepCosts(sorted(table), K, online=False)
    for bucket, row in table.items():
        for d, c in enumerate(row):
            costs.set(bucket, d, c)
    tracker = AcceptanceTracker(K, halflife=1e9, prior_weight=1e-9)
    for _ in range(1000):  # rows whose accepted-prefix distribution has exactly these tail rates
        for j, (hi, lo) in enumerate(zip(rates, [*rates[1:], 0.0], strict=True)):
            for _ in range(round((hi - lo) * 100)):
                tracker.record(K, j + 1)
        for _ in range(round((1 - rates[0]) * 100)):
            tracker.record(K, 0)
    assert tracker.rates() == pytest.approx(rates, abs=1e-6)
    picks = {}
    for batch, bucket in ((1, 1), (5, 8), (64, 64), (100, 64)):
        policy = AdaptiveDepth(costs, tracker, explore_steps=0, margin=0.0)
        picks[batch] = policy.choose(batch).depth
        assert picks[batch] == best_by_brute_force(table, rates, bucket), (batch, picks)
    assert picks[1] >= picks[5] >= picks[64]


def test_policy_measures_unmeasured_depths_and_keeps_the_current_one_within_the_margin() -> None:
    """Online costs: a depth without a measured cost is chosen first; observations are averaged; a depth
    within `margin` of the best is kept."""
    costs = StepCosts([1, 2], 1, smoothing=0.5)
    tracker = AcceptanceTracker(1, prior=0.5, prior_weight=1.0)
    policy = AdaptiveDepth(costs, tracker, explore_steps=0, margin=0.1)
    assert policy.choose(1) == StepKind(0)
    costs.observe(1, 0, 1.0)
    assert policy.choose(1) == StepKind(1)
    costs.observe(1, 1, 2.0)
    costs.observe(1, 1, 1.0)
    assert costs.get(1, 1) == pytest.approx(1.5)  # expected tokens 1.5 / 1.5 s against 1 / 1 s: a tie
    policy.kind = StepKind(1)
    assert policy.choose(1) == StepKind(1)
    costs.observe(1, 1, 1.55)  # depth 1 now 3 % below depth 0: within the margin, but below target-only
    assert policy.choose(1) == StepKind(0)
    policy.kind = StepKind(1)
    costs.observe(1, 1, 10.0)  # far below depth 0
    assert policy.choose(1) == StepKind(0)
    with pytest.raises(ValueError, match="depth in \\[0, 1\\]"):
        costs.observe(1, 2, 1.0)


def test_policy_explores_one_depth_deeper_on_schedule() -> None:
    """Every `explore_every` decisions, `explore_steps` decisions run one deeper than the best depth (here
    depth 1 expects 1.6 tokens at 1.8 s, below depth 0, but could give 2 tokens: worth measuring)."""
    costs = StepCosts([1], 2, online=False)
    for d, c in enumerate([1.0, 1.8, 9.0]):
        costs.set(1, d, c)
    policy = AdaptiveDepth(costs, AcceptanceTracker(2), explore_every=8, explore_steps=2)
    picks = [policy.choose(1).depth for _ in range(24)]
    assert picks == [(1 if i % 8 < 2 else 0) for i in range(1, 25)]
    assert policy.steps_per_depth == [picks.count(0), picks.count(1), 0]


def test_policy_never_explores_a_depth_that_cannot_win() -> None:
    """A depth whose cost exceeds its most tokens per step (d + 1) times depth 0's is never run, not even to
    explore."""
    costs = StepCosts([1], 2, online=False)
    for d, c in enumerate([1.0, 2.5, 9.0]):
        costs.set(1, d, c)
    policy = AdaptiveDepth(costs, AcceptanceTracker(2), explore_every=4, explore_steps=2)
    assert {policy.choose(1) for _ in range(40)} == {StepKind(0)}


# ---- the engine ------------------------------------------------------------------------------------


PARAMS = [{"max_tokens": 40}, {"max_tokens": 6}, {"max_tokens": 14}, {"max_tokens": 25}]


@pytest.mark.parametrize("fused,overlap", [(False, False), (True, False), (True, True)])
def test_adaptive_depths_give_the_target_only_tokens(fused: bool, overlap: bool) -> None:
    """Greedy requests of different lengths, so the batch shrinks and the depth changes (0 at four
    requests, 1 at three or two, 3 alone): tokens equal target-only decoding, through the eager runner and
    the fused steps of every depth (with steps launched ahead too), and drafts still get accepted."""
    args, w = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [17, 5, 11, 23], seed=4)
    want = run(tiny_engine(args, w), prompts, PARAMS)
    eng = adaptive_engine(forced_policy({1: 3, 2: 1, 4: 0, 8: 0}), fused, overlap)
    got = run(eng, prompts, PARAMS)
    assert got == want
    used = eng.scheduler.depth.steps_per_depth  # type: ignore[union-attr]
    assert used[0] > 0 and used[1] > 0 and used[3] > 0, used
    assert eng.totals.accepted > 0
    assert eng.totals.drafted <= sum(used[d] * d for d in range(K + 1)) * len(prompts)


def staggered(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Tokens per request when the three requests arrive at steps 0, 2 and 4 while the others decode."""
    tokens: dict[str, list[int]] = {}
    steps = 0
    while steps < 4 or eng.has_unfinished():
        if steps in (0, 2, 4):
            i = steps // 2
            eng.add_request(prompts[i], params[i], request_id=f"r{i}")
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    return tokens


def test_captured_prefill_proposes_the_step_depth() -> None:
    """Requests arriving one by one while others decode (lone prompt chunks, and chunks split from the
    generation rows) through the prefill step, which drafts K and keeps the step's depth: tokens equal
    target-only decoding."""
    args, w = mimic_target()
    prompts = random_prompts(3, args.vocab_size, [40, 9, 21], seed=6)
    params = [{"max_tokens": 30}, {"max_tokens": 12}, {"max_tokens": 20}]

    want = staggered(tiny_engine(args, w), prompts, params)
    eng = adaptive_engine(forced_policy({1: 1, 2: 2, 4: 0, 8: 0}), fused=True, prefill=True)
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    used: list[int] = []
    orig = runner.steps.prefill.launch

    def counted(plan: Any, bucket: int, keys: list[int] | None = None) -> Any:
        used.append(plan.num_draft_tokens)
        return orig(plan, bucket, keys)

    runner.steps.prefill.launch = counted
    assert staggered(eng, prompts, params) == want
    assert len(set(used)) >= 2, used


def token_counts(eng: LLMEngine, prompt: list[int], n: int, vocab: int, index: int) -> torch.Tensor:
    """How often each token comes at `index` of the output over n requests sampled at temperature 1 (of two
    lengths, so that they finish apart and the batch passes through every bucket as it empties)."""
    params = [{"max_tokens": index + 1 + s % 2, "temperature": 1.0, "seed": s} for s in range(n)]
    tokens = run(eng, [prompt] * n, params)
    return torch.bincount(torch.tensor([t[index] for t in tokens.values()]), minlength=vocab)


def test_adaptive_sampling_keeps_the_target_distribution() -> None:
    """Sampling while the depth changes with the batch (0, 1, 2 and 3 all used, through the fused steps with
    steps launched ahead): the fourth token has the target's distribution at temperature 1 (chi-square over
    600 requests against target-only sampling)."""
    args, w = mimic_target()
    prompt = random_prompts(1, args.vocab_size, [10], seed=2)[0]
    want = token_counts(tiny_engine(args, w), prompt, 600, args.vocab_size, 3)
    eng = adaptive_engine(forced_policy({1: 0, 2: 1, 4: 2, 8: 3}), fused=True, overlap=True)
    got = token_counts(eng, prompt, 600, args.vocab_size, 3)
    used = eng.scheduler.depth.steps_per_depth  # type: ignore[union-attr]
    assert all(u > 0 for u in used), used
    assert eng.totals.accepted > 0
    assert same_distribution_pvalue([want, got]) > 1e-3


@pytest.mark.parametrize("fused", [False, True])
def test_depth_zero_keeps_the_draft_kv_current(fused: bool) -> None:
    """While two requests run at depth 0 (no drafts), the draft still writes its KV: once alone at depth 3,
    the long request's draft KV over its accepted positions equals that of a run at fixed K = 3."""
    args, w = mimic_target()
    prompts = random_prompts(2, args.vocab_size, [13, 7], seed=9)
    params = [{"max_tokens": 40}, {"max_tokens": 12}]

    def advance(eng: LLMEngine, until: int) -> int:
        for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(p, q, request_id=f"r{i}")
        while eng.scheduler.requests["r0"].num_computed_tokens < until:
            eng.step()
        eng.drain()
        return eng.scheduler.requests["r0"].num_computed_tokens

    until = len(prompts[0]) + 30
    eng = adaptive_engine(forced_policy({1: 3, 2: 0, 4: 0, 8: 0}), fused)
    fixed = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": K})
    n = min(advance(eng, until), advance(fixed, until))
    used = eng.scheduler.depth.steps_per_depth  # type: ignore[union-attr]
    assert used[0] >= 10 and used[3] > 0, used
    torch.testing.assert_close(draft_kv(eng, "r0", n), draft_kv(fixed, "r0", n), atol=1e-5, rtol=1e-5)


def test_online_costs_come_from_the_engines_own_steps() -> None:
    """Without timed fused steps, the policy measures each depth it runs: after decoding, each depth of
    bucket 1 has a cost, and output equals target-only."""
    args, w = mimic_target()
    prompts = random_prompts(1, args.vocab_size, [12], seed=5)
    want = run(tiny_engine(args, w), prompts, [{"max_tokens": 30}])
    eng = adaptive_engine(None)
    policy = eng.scheduler.depth
    assert policy is not None and policy.costs.online
    assert run(eng, prompts, [{"max_tokens": 30}]) == want
    assert all(policy.costs.get(1, d) is not None for d in range(K + 1))


def test_fused_depth_steps_time_every_depth_and_bucket() -> None:
    """The timed costs cover every (bucket, depth) and are positive."""
    eng = adaptive_engine(None, fused=True)
    fused = eng.target.steps.chain  # type: ignore[attr-defined]
    costs = fused.time_steps(repeats=1)
    assert sorted(costs) == sorted((b, d) for d in range(K + 1) for b in fused.by_depth[d].steps.sizes)
    assert all(c > 0 for c in costs.values())


def test_adaptive_config_and_flag() -> None:
    """Adaptive is the default where it applies (chains of one reused head, trees of more nodes than the
    deepest chain's drafts) and off where it cannot, unless asked for, which is refused there;
    `--no-spec-adaptive` turns it off."""
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert config_from_args(p.parse_args([])).speculative.adaptive is True
    assert config_from_args(p.parse_args(["--spec-adaptive"])).speculative.adaptive is True
    assert config_from_args(p.parse_args(["--no-spec-adaptive"])).speculative.adaptive is False
    vanilla = config_from_args(p.parse_args(["--spec-method", "mtp_vanilla"])).speculative
    assert vanilla.adaptive is False
    assert SpeculativeConfig(tree_budget=3, tree_width=2).adaptive is False  # a tree no bigger than the chain
    assert SpeculativeConfig(tree_budget=8, tree_width=3).adaptive is True
    with pytest.raises(ValidationError, match="adaptive"):
        SpeculativeConfig(adaptive=True, tree_budget=3, tree_width=2)  # no more nodes than the deepest chain
    with pytest.raises(ValidationError, match="adaptive"):
        SpeculativeConfig(adaptive=True, method="mtp_vanilla")
    assert SpeculativeConfig(adaptive=True, tree_budget=6, tree_width=2).scratch_slots == 4


def test_scheduler_cuts_or_pads_the_stored_drafts_to_the_step_depth() -> None:
    """A step deeper than the drafts its request holds pads them with the last token, and the padding is
    left out of the acceptance counts; a shallower step keeps the first drafts."""
    from mtpserve.cluster.engine.request import Request
    from mtpserve.cluster.engine.sampling_params import SamplingParams
    from mtpserve.cluster.engine.scheduler import Scheduler
    from mtpserve.speculative.messages import DraftOutputs, SeqResult, TargetOutput
    from mtpserve.workers.config import SchedulerConfig

    policy = forced_policy({1: 1})
    sched = Scheduler(SchedulerConfig(block_size=4), 64, K, eos_token_ids=[], max_model_len=256, depth=policy)
    sched.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=20)))
    prefill = sched.schedule()
    assert prefill.num_draft_tokens == 1
    sched.update(prefill, TargetOutput(prefill.step_id, [SeqResult("a", [9])]), None)
    sched.apply_drafts(DraftOutputs(prefill.step_id, ["a"], torch.tensor([[11, 12, 13]])))
    cut = sched.schedule()
    assert cut.num_draft_tokens == 1 and cut.seqs[0].token_ids == [9, 11]
    sched.update(cut, TargetOutput(cut.step_id, [SeqResult("a", [11, 4], 1, 1)]), None)
    sched.apply_drafts(DraftOutputs(cut.step_id, ["a"], torch.tensor([[21]])))
    policy.costs.set(1, 1, 100.0)
    policy.costs.set(1, 3, 1.0)
    padded = sched.schedule()
    assert padded.num_draft_tokens == 3 and padded.seqs[0].token_ids == [4, 21, 4, 4]
    sched.update(padded, TargetOutput(padded.step_id, [SeqResult("a", [21, 8], 3, 1)]), None)
    stats = sched.requests["a"].stats
    assert (stats.drafted, stats.accepted, stats.verify_steps) == (2, 2, 2)
    assert stats.drafted_per_position == [2]


def test_prometheus_counts_steps_per_depth() -> None:
    """The per-depth step counters follow the policy's running totals; the gauge shows its depth."""
    from mtpserve.cluster.service.metrics import ServerMetrics

    m = ServerMetrics()
    assert m.engine is not None
    m.engine.observe_depths({"0": 3, "1": 0, "2": 5}, 2)
    m.engine.observe_depths({"0": 4, "1": 2, "2": 5, "3": 1, "tree16": 7}, 3)
    labels = ["0", "1", "2", "3", "tree16"]
    got = [m.registry.get_sample_value("mtpserve_spec_steps_per_depth_total", {"depth": d}) for d in labels]
    assert got == [4.0, 2.0, 5.0, 1.0, 7.0]
    assert m.registry.get_sample_value("mtpserve_spec_depth") == 3.0


def test_warm_up_runs_the_input_advance_and_leaves_the_buffers_padded() -> None:
    """A fused step's warm-up (run at build, so the first launched step of a depth does not compile) leaves
    its buffers as freshly padded ones, at depth 0 and at depth K."""
    eng = adaptive_engine(None)
    runner = eng.target
    assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleChain)
    for depth in (0, K):
        step = FusedSpecStep(
            runner.model, runner.cache, eng.draft, depth, max_batch=8, max_blocks=16, device="cpu", use_graphs=False
        )
        fresh = step.buffers.packed.clone()
        step.buffers.input_ids.fill_(5)
        step.warm_up()
        assert torch.equal(step.buffers.packed, fresh)


def test_observed_periods_replace_timed_costs_and_calibrate_the_rest() -> None:
    """Timed 0.8 / 1.0 / 1.1 / 1.15 at depth 0..3 in bucket 8 favour depth 3. Seen running, depth 3's period is
    2.0 and depth 2's 1.2: they cost that, depth 1 its timed cost x the mean seen / timed ratio, and depth 2
    wins. Another bucket keeps its timed costs."""
    costs = StepCosts([1, 8], K, online=False)
    for bucket in (1, 8):
        for depth, seconds in ((0, 0.8), (1, 1.0), (2, 1.1), (3, 1.15)):
            costs.set(bucket, depth, seconds)
    policy = AdaptiveDepth(costs, AcceptanceTracker(K, prior=0.5), explore_steps=0, margin=0.0)
    assert policy.best(8) == StepKind(3)
    for _ in range(60):
        costs.observe_period(8, 3, 2.0)
        costs.observe_period(8, 2, 1.2)
    assert costs.get(8, 3) == pytest.approx(2.0) and costs.get(8, 2) == pytest.approx(1.2)
    assert costs.get(8, 1) == pytest.approx(1.0 * (2.0 / 1.15 + 1.2 / 1.1) / 2)
    assert costs.get(1, 3) == 1.15
    assert policy.best(8) == StepKind(2) and policy.best(1) == StepKind(3)


def test_policy_explores_one_depth_shallower_too() -> None:
    """With depth 3 best, exploring runs depth 2 (the deepest has nothing deeper), so its real cost gets seen."""
    costs = StepCosts([1], K, online=False)
    for d, c in enumerate([1.0, 1.05, 1.1, 1.12]):
        costs.set(1, d, c)
    policy = AdaptiveDepth(costs, AcceptanceTracker(K, prior=0.8), explore_every=8, explore_steps=2)
    picks = [policy.choose(1).depth for _ in range(24)]
    assert picks == [(2 if i % 8 < 2 else 3) for i in range(1, 25)]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_reports_steady_periods_when_steps_queue_ahead(overlap: bool) -> None:
    """With steps launched ahead (fixed-buffer steps, timed costs) the engine reports the period of steps of one
    kind in a row, per bucket and kind; without queueing it has nothing to report."""
    policy = forced_policy({1: 3, 2: 1, 4: 0, 8: 0})
    eng = adaptive_engine(policy, fused=True, overlap=overlap)
    args, _ = mimic_target()
    run(eng, random_prompts(4, args.vocab_size, [17, 5, 11, 23], seed=4), PARAMS)
    seen = policy.costs.periods
    assert bool(seen) == overlap, seen
    assert all(0 < s < 5.0 for s in seen.values())
    assert {kind for _, kind in seen} <= {StepKind(0), StepKind(1), StepKind(3)}
