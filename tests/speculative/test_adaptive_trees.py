"""Adaptive speculation over chains and a draft tree in the engine: steps switch between tree and chain
kinds from one step to the next, greedy output stays target-only's, sampling keeps the target's
distribution, and the draft KV stays exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.workers.builders import tree_kind
from mtpserve.workers.fused_step import FusedDepthSteps, FusedSpecStep
from mtpserve.workers.prefill_step import CapturedPrefill
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.tree_step import FusedTreeStep
from tests.helpers.tiny import (
    draft_kv,
    mimic_head,
    mimic_target,
    random_prompts,
    same_distribution_pvalue,
    tiny_engine,
    with_steps,
)
from tests.speculative.test_adaptive import PARAMS, run, staggered, token_counts

K = 3
SPEC = {"num_draft_tokens": K, "adaptive": True, "tree_budget": 8, "tree_width": 3}
TREE = "tree"


def forced(eng: LLMEngine, kind_by_bucket: dict[int, int | str]) -> AdaptiveDepth:
    """Give the engine a policy whose costs make one kind per bucket far cheaper than the others (an int is a
    chain depth, TREE the engine's tree)."""
    assert isinstance(eng.draft, MTPEagleTree)
    tree = tree_kind(eng.draft)
    costs = StepCosts(sorted(kind_by_bucket), K, online=False, trees=[tree])
    for bucket, want in kind_by_bucket.items():
        chosen = tree if want == TREE else StepKind(int(want))
        for kind in [*(StepKind(d) for d in range(K + 1)), tree]:
            costs.set(bucket, kind, 1.0 if kind == chosen else 100.0)
    eng.scheduler.depth = policy = AdaptiveDepth(costs, AcceptanceTracker(K), explore_steps=0)
    return policy


def tree_adaptive_engine(fused: bool = False, overlap: bool = False, prefill: bool = False) -> LLMEngine:
    """A tiny mimic engine, adaptive over chains of depth 0..3 and an 8-node tree (width 3); `fused` runs
    generation steps through the fixed-buffer fused depth steps and tree step (the functions CUDA captures),
    `prefill` lone prompt chunks through the fixed-buffer prefill step (K chain drafts)."""
    args, w = mimic_target()
    model = {"overlap_steps": overlap, "overlap_speculative": overlap}
    sched = {"chunk_size": 32, "max_num_batched_tokens": 64}
    eng = tiny_engine(args, w, mimic_head(args, w), model=model, speculative=SPEC, scheduler=sched)
    runner, drafter = eng.target, eng.draft
    assert isinstance(runner, TargetRunner) and isinstance(drafter, MTPEagleTree) and drafter.chains
    if fused:
        steps = {
            d: FusedSpecStep(
                runner.model, runner.cache, drafter.chain, d, max_batch=8, max_blocks=16, device="cpu", use_graphs=False
            )
            for d in range(K + 1)
        }
        tree_step = FusedTreeStep(
            runner.model, runner.cache, drafter, max_batch=8, max_blocks=16, device="cpu", use_graphs=False
        )
        runner = with_steps(eng, chain=FusedDepthSteps(steps), tree=tree_step)
    if prefill:
        prefill_step = CapturedPrefill(
            runner.model, runner.cache, drafter.chain, K, max_tokens=32, max_blocks=16, device="cpu", use_graphs=False
        )
        runner = with_steps(eng, prefill=prefill_step)
    return eng


def kinds_run(policy: AdaptiveDepth) -> tuple[int, int]:
    """(tree steps, speculative chain steps) the policy scheduled."""
    return policy.tree_steps, sum(policy.steps_per_depth[1:])


@pytest.mark.parametrize("fused,overlap", [(False, False), (True, False), (True, True)])
def test_switching_between_trees_and_chains_gives_the_target_only_tokens(fused: bool, overlap: bool) -> None:
    """Greedy requests of different lengths, so the batch shrinks and the kind changes (the tree alone and at
    three or four requests, depth 1 at two, then depth 3 at eight when a second wave comes): tokens equal
    target-only decoding through the eager runner and the fixed-buffer steps (with chain and tree steps
    launched ahead too), and both trees and chains ran and got drafts accepted."""
    args, w = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [17, 5, 11, 23], seed=4)
    want = run(tiny_engine(args, w), prompts, PARAMS)
    eng = tree_adaptive_engine(fused, overlap)
    policy = forced(eng, {1: TREE, 2: 1, 4: TREE, 8: 3})
    chain_reads: list[int] = []
    if fused:  # count the fixed-buffer chain steps read back, by depth
        for step in eng.target.steps.chain.by_depth.values():  # type: ignore[attr-defined]
            step.read = lambda plan, host, read=step.read: chain_reads.append(plan.num_draft_tokens) or read(plan, host)
    proposed: list[tuple[int, int, bool]] = []  # the in-process drafter's proposals: (asked, drafts, a tree)
    drafter = eng.draft
    assert isinstance(drafter, MTPEagleTree)
    propose = drafter.propose

    def counted(inputs: Any) -> Any:
        out = propose(inputs)
        if out.request_ids:
            proposed.append((inputs.num_draft_tokens, out.draft_token_ids.shape[1], out.draft_parents is not None))
        return out

    drafter.propose = counted  # type: ignore[method-assign]
    tree_after = 0
    if fused:
        tree_launch = eng.target.steps.tree.launch  # type: ignore[attr-defined]

        def launch(plan: Any, bucket: int, thresholds: Any = None, after: Any = None) -> Any:
            nonlocal tree_after
            tree_after += after is not None
            return tree_launch(plan, bucket, thresholds, after)

        eng.target.steps.tree.launch = launch  # type: ignore[attr-defined]
    assert run(eng, prompts, PARAMS) == want
    more = random_prompts(6, args.vocab_size, [9, 14, 3, 20, 7, 12], seed=7)
    params = [{"max_tokens": m} for m in (12, 30, 8, 16, 22, 5)]
    assert run(tiny_engine(args, w), more, params) == run(eng, more, params)
    trees, chains = kinds_run(policy)
    assert trees > 5 and chains > 5, policy.step_counts()
    assert policy.steps_per_depth[3] > 0
    assert eng.totals.accepted > 0
    budget = SPEC["tree_budget"]
    assert all((n, n == budget) == (d, tree) for n, d, tree in proposed), proposed  # trees only where asked
    if not fused:
        assert {n for n, _, _ in proposed} == {1, 3, budget}
    if fused:  # the fixed-buffer steps ran both kinds
        assert eng.target.steps.tree.runs > 5 and {1, 3} <= set(chain_reads), chain_reads  # type: ignore[attr-defined]
    if overlap:
        assert tree_after > 5, "tree steps were launched ahead, their inputs taken from the tree step before"


@pytest.mark.parametrize("fused", [False, True])
def test_tree_and_chain_steps_in_turn_keep_the_draft_kv_exact(fused: bool) -> None:
    """One request whose kind flips every few steps (the costs change under it): once it has run trees and
    chains (depth 0 among them), its draft KV over the accepted positions equals that of a fixed K = 3 chain
    run."""
    args, w = mimic_target()
    prompt = random_prompts(1, args.vocab_size, [13], seed=9)[0]
    eng = tree_adaptive_engine(fused=fused)
    policy = forced(eng, {1: TREE})
    tree = policy.kind_of(SPEC["tree_budget"])
    fixed = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": K})
    for e in (eng, fixed):
        e.add_request(prompt, {"max_tokens": 60}, request_id="r0")
    steps = 0
    cycle = [tree, StepKind(2), tree, StepKind(0)]  # three steps each, round and round
    while eng.scheduler.requests["r0"].num_computed_tokens < len(prompt) + 40:
        want = cycle[(steps // 3) % len(cycle)]
        for kind in policy.kinds:
            policy.costs.set(1, kind, 1.0 if kind == want else 100.0)
        eng.step()
        steps += 1
    while fixed.scheduler.requests["r0"].num_computed_tokens < eng.scheduler.requests["r0"].num_computed_tokens:
        fixed.step()
    n = eng.scheduler.requests["r0"].num_computed_tokens
    counts = policy.step_counts()
    assert counts["tree8"] >= 5 and counts["2"] >= 3 and counts["0"] >= 3, counts
    torch.testing.assert_close(draft_kv(eng, "r0", n), draft_kv(fixed, "r0", n), atol=1e-5, rtol=1e-5)


def test_sampling_across_tree_and_chain_steps_keeps_the_target_distribution() -> None:
    """Sampling while the kind changes with the batch (trees, chains and reshaped drafts both ways, through
    the fixed-buffer steps): the fourth token has the target's distribution at temperature 1 (chi-square over
    600 requests against target-only sampling)."""
    args, w = mimic_target()
    prompt = random_prompts(1, args.vocab_size, [10], seed=2)[0]
    want = token_counts(tiny_engine(args, w), prompt, 600, args.vocab_size, 3)
    eng = tree_adaptive_engine(fused=True)
    policy = forced(eng, {1: 2, 2: TREE, 4: 1, 8: TREE})
    got = token_counts(eng, prompt, 600, args.vocab_size, 3)
    trees, chains = kinds_run(policy)
    assert trees > 0 and chains > 0, policy.step_counts()
    assert eng.totals.accepted > 0
    assert same_distribution_pvalue([want, got]) > 1e-3


def test_prompt_chunks_of_tree_steps_take_the_captured_prefill() -> None:
    """Requests arriving one by one while others decode: a lone prompt chunk in a tree step runs the
    fixed-buffer prefill step, whose K chain drafts the next tree step takes as its first branch; chunks
    mixed with chain steps split from them; tokens equal target-only decoding."""
    args, w = mimic_target()
    prompts = random_prompts(3, args.vocab_size, [40, 9, 21], seed=6)
    params = [{"max_tokens": 30}, {"max_tokens": 12}, {"max_tokens": 20}]

    want = staggered(tiny_engine(args, w), prompts, params)
    eng = tree_adaptive_engine(fused=True, prefill=True)
    policy = forced(eng, {1: TREE, 2: 2, 4: TREE, 8: 0})
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    used: list[int] = []
    run_prefill = runner.steps.prefill.launch

    def counted(plan: Any, bucket: int, keys: list[int] | None = None) -> Any:
        used.append(plan.num_draft_tokens)
        return run_prefill(plan, bucket, keys)

    runner.steps.prefill.launch = counted
    assert staggered(eng, prompts, params) == want
    assert SPEC["tree_budget"] in used and 2 in used, used
    assert policy.tree_steps > 0 and eng.totals.accepted > 0


def test_online_costs_cover_the_tree() -> None:
    """Without timed steps the policy measures every kind it runs, the tree included; output equals
    target-only."""
    args, w = mimic_target()
    prompts = random_prompts(1, args.vocab_size, [12], seed=5)
    want = run(tiny_engine(args, w), prompts, [{"max_tokens": 30}])
    eng = tree_adaptive_engine()
    policy = eng.scheduler.depth
    assert policy is not None and policy.costs.online and policy.costs.trees
    assert run(eng, prompts, [{"max_tokens": 30}]) == want
    assert all(policy.costs.get(1, kind) is not None for kind in policy.kinds)


def test_timed_tree_costs_join_the_depth_costs() -> None:
    """With fixed-buffer steps the policy's costs are timed per bucket for every depth and for the tree, and
    all stay as timed while the engine runs them (tree steps are launched ahead as chain steps are)."""
    from mtpserve.workers.builders import depth_policy

    eng = tree_adaptive_engine(fused=True)
    runner = eng.target
    assert isinstance(runner, TargetRunner) and isinstance(eng.draft, MTPEagleTree)
    policy = depth_policy(eng.cfg, K, runner.steps.chain, tree=tree_kind(eng.draft), tree_step=runner.steps.tree)
    assert not policy.costs.online and len(policy.kinds) == K + 2
    assert all(policy.costs.get(b, kind) for b in runner.steps.tree.steps.sizes for kind in policy.kinds)
    tree = policy.kind_of(SPEC["tree_budget"])
    for d in range(K + 1):
        policy.costs.set(1, d, 100.0)  # the tree wins at batch 1
    timed = policy.costs.get(1, tree)
    eng.scheduler.depth = policy
    args, _ = mimic_target()
    run(eng, random_prompts(1, args.vocab_size, [12], seed=5), [{"max_tokens": 20}])
    assert policy.tree_steps > 3 and eng.target.steps.tree.runs > 3  # type: ignore[attr-defined]
    assert policy.costs.get(1, tree) == timed, "the timed tree cost stays"
    assert all(policy.costs.get(1, d) == 100.0 for d in range(K + 1)), "timed chain costs stay"


def test_scheduler_reshapes_stored_drafts_between_kinds() -> None:
    """A chain proposal verified by a tree step becomes the first branch of a padded tree, the row counting
    only the chain's drafts and leaving the tree's acceptance alone; a tree proposal verified by a chain step
    gives its first branch."""
    from mtpserve.cluster.engine.request import Request
    from mtpserve.cluster.engine.sampling_params import SamplingParams
    from mtpserve.cluster.engine.scheduler import Scheduler
    from mtpserve.speculative.messages import DraftOutputs, SeqResult, TargetOutput
    from mtpserve.workers.config import SchedulerConfig

    tree = StepKind.tree(3, 6, 2)
    costs = StepCosts([1], K, online=False, trees=[tree])
    for kind in [*(StepKind(d) for d in range(K + 1)), tree]:
        costs.set(1, kind, 1.0 if kind == tree else 100.0)
    policy = AdaptiveDepth(costs, AcceptanceTracker(K), explore_steps=0)
    sched = Scheduler(
        SchedulerConfig(block_size=4),
        64,
        tree.budget,
        eos_token_ids=[],
        max_model_len=256,
        scratch_slots=4,
        depth=policy,
    )
    sched.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=20)))
    prefill = sched.schedule()
    assert prefill.num_draft_tokens == 6
    sched.update(prefill, TargetOutput(prefill.step_id, [SeqResult("a", [9])]), None)
    sched.apply_drafts(DraftOutputs(prefill.step_id, ["a"], torch.tensor([[11, 12]])))  # a chain
    padded = sched.schedule()
    row = padded.seqs[0]
    assert padded.num_draft_tokens == 6 and len(row.token_ids) == 7 and row.draft_parents is not None
    assert row.token_ids[:3] == [9, 11, 12] and row.draft_parents[:2] == [0, 1]
    before = policy.trees[tree].rows
    sched.update(padded, TargetOutput(padded.step_id, [SeqResult("a", [11, 12, 4], 3, 2)]), None)
    assert policy.trees[tree].rows == before, "a reshaped row says nothing about trees"
    stats = sched.requests["a"].stats
    assert (stats.drafted, stats.accepted) == (2, 2)
    tree_drafts = torch.tensor([[21, 22, 23, 24, 25, 26]])
    parents = torch.tensor([[0, 0, 1, 1, 3, 2]])
    sched.apply_drafts(DraftOutputs(padded.step_id, ["a"], tree_drafts, draft_parents=parents))
    real_tree = sched.schedule()
    assert real_tree.seqs[0].token_ids == [4, 21, 22, 23, 24, 25, 26]
    sched.update(real_tree, TargetOutput(real_tree.step_id, [SeqResult("a", [21, 23, 8], 3, 2)]), None)
    assert policy.trees[tree].rows == before + 1
    sched.apply_drafts(DraftOutputs(real_tree.step_id, ["a"], tree_drafts, draft_parents=parents))
    costs.set(1, tree, 100.0)
    costs.set(1, 2, 1.0)
    chain = sched.schedule()
    assert (
        chain.num_draft_tokens == 2 and chain.seqs[0].token_ids == [8, 21, 23] and chain.seqs[0].draft_parents is None
    )


@pytest.mark.parametrize("chunk", [3, 7])
def test_draft_kv_stays_chunk_invariant_while_kinds_switch(chunk: int) -> None:
    """Two prompts prefilled in chunks (the prompt lookahead at every chunk end) while the other decodes, and
    the kind switching every step (tree, depth 2, depth 0), so chunks run in steps of every kind: each
    request's draft KV over its computed positions equals a whole-prompt fixed K = 3 chain run's."""
    args, w = mimic_target()
    prompts = random_prompts(2, args.vocab_size, [29, 17], seed=12)
    sched = {"chunk_size": chunk, "max_num_batched_tokens": 64}
    eng = tiny_engine(args, w, mimic_head(args, w), speculative=SPEC, scheduler=sched)
    policy = forced(eng, {1: TREE, 2: TREE, 4: TREE, 8: TREE})
    cycle = [policy.kind_of(SPEC["tree_budget"]), StepKind(2), StepKind(0)]
    steps = 0

    def step() -> None:
        nonlocal steps
        for bucket in policy.costs.buckets:
            for kind in policy.kinds:
                policy.costs.set(bucket, kind, 1.0 if kind == cycle[steps % len(cycle)] else 100.0)
        eng.step()
        steps += 1

    eng.add_request(prompts[0], {"max_tokens": 40}, request_id="r0")
    for _ in range(4):
        step()
    eng.add_request(prompts[1], {"max_tokens": 40}, request_id="r1")
    rids = ("r0", "r1")
    while any(eng.scheduler.requests[r].num_computed_tokens < len(p) + 12 for r, p in zip(rids, prompts, strict=True)):
        step()
    assert policy.tree_steps > 3 and policy.steps_per_depth[2] > 3, policy.step_counts()
    for rid, prompt in zip(rids, prompts, strict=True):
        fixed = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": K})
        fixed.add_request(prompt, {"max_tokens": 60}, request_id=rid)
        n = eng.scheduler.requests[rid].num_computed_tokens
        while fixed.scheduler.requests[rid].num_computed_tokens < n:
            fixed.step()
        torch.testing.assert_close(draft_kv(eng, rid, n), draft_kv(fixed, rid, n), atol=1e-5, rtol=1e-5)
