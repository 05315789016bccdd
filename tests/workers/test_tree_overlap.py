"""Tree steps launched ahead: the next tree step is launched before this one's tokens are read, its tokens,
positions and tree taken from this step's results on the device. Run eagerly on CPU over the fixed buffers
that CUDA captures, against the same engine reading every tree step before planning the next."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.workers.message_checks import StepLimits, check_plan
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.tree_step import FusedTreeStep
from tests.helpers.tiny import draft_kv, mimic_head, mimic_target, random_prompts, tiny_engine, with_steps
from tests.workers.test_overlap import drive as overlap_drive

TREE = {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3}


def tree_engine(overlap: bool, spec: dict[str, int] = TREE, ahead: int = 1) -> tuple[LLMEngine, list[int]]:
    """A tiny mimic engine drafting trees through the fixed-buffer tree step, `ahead` tree steps launched ahead
    or none; records, per tree launch, whether it read its inputs from the previous step."""
    args, w = mimic_target()
    model = {"overlap_steps": overlap, "overlap_speculative": overlap, "steps_ahead": ahead}
    sched = {"chunk_size": 512, "max_num_batched_tokens": 128}
    eng = tiny_engine(args, w, mimic_head(args, w), model=model, speculative=spec, scheduler=sched)
    runner, drafter = eng.target, eng.draft
    assert isinstance(runner, TargetRunner) and isinstance(drafter, MTPEagleTree)
    runner = with_steps(
        eng,
        tree=FusedTreeStep(
            runner.model, runner.cache, drafter, max_batch=8, max_blocks=16, device="cpu", use_graphs=False
        ),
    )
    chained: list[int] = []
    launch = runner.launch

    def spy(plan, after=None):  # type: ignore[no-untyped-def]
        launched = launch(plan, after)
        if launched is not None and launched.tree:
            chained.append(int(after is not None))
        return launched

    runner.launch = spy  # type: ignore[method-assign]
    return eng, chained


def drive(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]], late: bool) -> dict[str, Any]:
    """`test_overlap.drive` with request 3 after 3 steps (or from the start) and request 2 aborted after 5."""
    return overlap_drive(eng, prompts, params, late_at=3 if late else None, abort_at=5)


def case() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Four prompts with a stop token, max_tokens limits and room for a late arrival and an abort."""
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [21, 5, 13, 9], seed=11)
    params: list[dict[str, Any]] = [{"max_tokens": 40}, {"max_tokens": 9}, {"max_tokens": 60}, {"max_tokens": 17}]
    params[0] = stop_on(prompts[0], params[0], 10)
    return prompts, params


def stop_on(prompt: list[int], params: dict[str, Any], at: int) -> dict[str, Any]:
    """`params` with a stop token: the one the engine emits at index `at` for `prompt`."""
    first = tree_engine(False)[0].generate([prompt], params)[0].token_ids
    return {**params, "stop_token_ids": [first[at]]}


@pytest.mark.parametrize(
    ("spec", "kernels", "ahead"),
    [
        (TREE, False, 1),
        ({"num_draft_tokens": 4, "tree_budget": 12, "tree_width": 2}, False, 1),
        (TREE, True, 1),
        (TREE, False, 2),
    ],
    ids=["d3", "d4", "d3-triton", "d3-two-ahead"],
)
def test_greedy_trees_launched_ahead_emit_the_same_tokens(
    spec: dict[str, int], kernels: bool, ahead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop token, max_tokens, a late arrival and an abort: the same tokens, finish reasons and acceptance
    counts as reading every tree step before planning the next, target-only's tokens, most tree steps launched
    ahead (one or two), and every KV block returned; with `kernels`, the launched steps' walks and inputs go
    through the tree step's Triton kernels (as on CUDA; interpreted here) and the torch ones never run."""
    if kernels:
        from mtpserve.modeling import fused_kernels
        from mtpserve.workers import tree_step

        if not fused_kernels.available():
            pytest.skip("triton is not installed")
        want_kernels = drive(tree_engine(False, spec)[0], *case(), late=True)
        monkeypatch.setattr(tree_step, "tree_kernels_apply", lambda t: True)
        monkeypatch.setattr(tree_step, "greedy_walk", None)
        monkeypatch.setattr(tree_step, "advance_trees", None)
        eng, chained = tree_engine(True, spec)
        assert drive(eng, *case(), late=True) == want_kernels
        assert sum(chained) >= 5
        return
    args, w = mimic_target()
    prompts, params = case()
    want = drive(tree_engine(False, spec)[0], prompts, params, late=True)
    eng, chained = tree_engine(True, spec, ahead)
    got = drive(eng, prompts, params, late=True)
    assert got == want
    assert want["reasons"] == {"r0": "stop", "r1": "length", "r2": None, "r3": "length"}  # r2 was aborted
    assert 0 < want["counts"][1] < want["counts"][0], "drafts are accepted and rejected"
    assert got["blocks_held"] == 0
    assert len(got["tokens"]["r0"]) <= 11 and len(got["tokens"]["r3"]) == 17
    target_only = tiny_engine(args, w).generate([prompts[1], prompts[3]], {"max_tokens": 9})
    assert got["tokens"]["r1"] == target_only[0].token_ids
    assert got["tokens"]["r3"][:9] == target_only[1].token_ids
    assert sum(chained) >= 5 and sum(chained) > len(chained) // 2, f"most tree steps must be launched ahead: {chained}"


@pytest.mark.parametrize("ahead", [1, 2])
def test_seeded_sampling_trees_launched_ahead_draw_the_same_tokens(ahead: int) -> None:
    """Sampling requests (temperature only, top-k / top-p) next to a greedy one, one stopping on a token and
    one aborted: each request draws its walk's thresholds in the same order launched ahead (one or two steps)
    or not, so the tokens and finish reasons are the same."""
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [12, 7, 16, 10], seed=5)
    params: list[dict[str, Any]] = [
        {"max_tokens": 30, "temperature": 0.9, "seed": 1},
        {"max_tokens": 14, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 2},
        {"max_tokens": 50, "temperature": 0.7, "seed": 3},
        {"max_tokens": 21},
    ]
    params[0] = stop_on(prompts[0], params[0], 8)
    want = drive(tree_engine(False)[0], prompts, params, late=False)
    eng, chained = tree_engine(True, TREE, ahead)
    got = drive(eng, prompts, params, late=False)
    assert got == want
    assert want["reasons"] == {"r0": "stop", "r1": "length", "r2": None, "r3": "length"}
    assert want["counts"][1] > 0 and got["blocks_held"] == 0
    assert sum(chained) >= 5 and sum(chained) > len(chained) // 2, chained


def test_tree_steps_launched_ahead_keep_the_draft_kv() -> None:
    """Two requests decoding: after many tree steps launched ahead, each request's draft KV over its computed
    positions equals that of the run that reads every step first."""
    args, _ = mimic_target()
    prompts = random_prompts(2, args.vocab_size, [15, 22], seed=8)
    engines = [tree_engine(False)[0], tree_engine(True)]
    ahead, chained = engines[1]
    for eng in (engines[0], ahead):
        for i, p in enumerate(prompts):
            eng.add_request(p, {"max_tokens": 80, "ignore_eos": True}, request_id=f"r{i}")
    while ahead.scheduler.requests["r0"].num_computed_tokens < len(prompts[0]) + 30:
        ahead.step()
    n = {rid: ahead.scheduler.requests[rid].num_computed_tokens for rid in ("r0", "r1")}
    while engines[0].scheduler.requests["r0"].num_computed_tokens < n["r0"]:
        engines[0].step()
    assert sum(chained) >= 5
    for rid, count in n.items():
        assert engines[0].scheduler.requests[rid].num_computed_tokens == count
        torch.testing.assert_close(draft_kv(ahead, rid, count), draft_kv(engines[0], rid, count), atol=1e-5, rtol=1e-5)


def test_a_tree_step_planned_ahead_carries_a_valid_placeholder_tree() -> None:
    """The step after a pending tree step points each request at its row with a placeholder tree a worker
    accepts (a tree of the drafter's depth, siblings distinct), one position per draft level plus one further
    than now, blocks for that; a request the pending step surely finishes is left out."""
    eng, _ = tree_engine(False)
    args = eng.args
    prompts = random_prompts(2, args.vocab_size, [6, 4], seed=2)
    eng.add_request(prompts[0], {"max_tokens": 30}, request_id="on")
    eng.add_request(prompts[1], {"max_tokens": 2}, request_id="ends")
    eng.step()  # prefill: one token and a tree each
    sched = eng.scheduler
    pending = sched.schedule()
    assert [len(s.token_ids) for s in pending.seqs] == [9, 9] and all(s.draft_parents for s in pending.seqs)
    ahead = sched.plan_ahead(pending)
    assert ahead is not None and [s.request_id for s in ahead.seqs] == ["on"]
    sp, req = ahead.seqs[0], sched.requests["on"]
    row = [s.request_id for s in pending.seqs].index("on")
    assert sp.token_ids[0] == row and len(sp.token_ids) == 9 and sp.draft_parents is not None
    assert sp.start == req.num_computed_tokens + TREE["num_draft_tokens"] + 1
    assert len(req.block_ids) * sched.cfg.block_size >= sched.slots_needed(sp.start + 9)
    limits = StepLimits(sched.blocks.num_blocks, sched.cfg.block_size, sched.max_model_len, args.vocab_size,
                        max_num_requests=8, max_num_batched_tokens=128, num_draft_tokens=8,
                        hidden_size=args.hidden_size, scratch_slots=eng.cfg.speculative.scratch_slots)  # fmt: skip
    check_plan(ahead, limits)
    assert eng.target.launch_spec().bucket_for(ahead) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
def test_the_device_advance_writes_what_the_host_fill_writes(kernel: bool) -> None:
    """For sequences pointing at arbitrary rows of a previous tree step's results (random trees up to the
    deepest, accepted counts 0..D, block-crossing positions), `advance_trees` (torch, or the Triton kernel
    CUDA runs, here interpreted) leaves the same tokens, positions, KV slots, lengths, parents, depths and
    ancestor masks as filling the buffers on the host from the trees and positions those rows hold; padding
    rows stay as the host padded them."""
    from mtpserve.modeling import fused_kernels
    from mtpserve.workers import tree_inputs, tree_kernels
    from mtpserve.workers.step_buffers import StepBuffers
    from mtpserve.workers.tree_inputs import ResultColumns, TreeBuffers

    if kernel and not fused_kernels.available():
        pytest.skip("triton is not installed")
    advance_trees = tree_kernels.advance_trees if kernel else tree_inputs.advance_trees

    depth, budget, bs, m, bucket = 4, 9, 4, 5, 8
    q, cols = budget + 1, ResultColumns(depth, budget)
    g = torch.Generator().manual_seed(0)
    previous = torch.randint(0, 90, (7, cols.width), generator=g)
    for r in range(7):  # a random tree of at most `depth` levels in each row
        parents, depths = [-1], [0]
        for j in range(1, q):
            p = int(torch.randint(0, j, (1,), generator=g))
            while depths[p] >= depth:
                p = parents[p]
            parents.append(p)
            depths.append(depths[p] + 1)
        previous[r, cols.parents] = torch.tensor(parents[1:])
    previous[:, cols.accepted] = torch.randint(0, depth + 1, (7,), generator=g)
    previous[:, cols.next_start] = torch.randint(0, 20, (7,), generator=g)
    rows = [6, 0, 3, 3, 5]
    tables = [torch.randperm(40, generator=g)[:10].tolist() for _ in range(m)]
    host, dev = (StepBuffers.allocate(8, q, 10, bs, 99, torch.device("cpu")) for _ in range(2))
    host_trees, dev_trees = (TreeBuffers(8, q, torch.device("cpu")) for _ in range(2))
    src = previous[rows]
    tokens = torch.cat([src.gather(1, src[:, cols.accepted : cols.accepted + 1]), src[:, cols.drafts]], dim=1)
    starts = src[:, cols.next_start].tolist()
    host.fill(tokens.tolist(), starts, tables, bucket)
    host_trees.fill(torch.cat([torch.full((m, 1), -1), src[:, cols.parents]], dim=1).numpy(), bucket)
    dev.fill([[r] + [0] * budget for r in rows], [0] * m, tables, bucket)
    for _ in range(2):  # stale trees in both host twins, then the queued fill
        dev_trees.fill(torch.zeros(m, q, dtype=torch.long).numpy(), bucket)
    dev_trees.fill_launched(m, bucket)
    advance_trees(previous, cols, dev, dev_trees, m=m)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        assert torch.equal(getattr(dev, name), getattr(host, name)), name
    for name in ("depth", "parents", "mask"):
        assert torch.equal(getattr(dev_trees, name), getattr(host_trees, name)), name
    assert int(host_trees.depth[:m].max()) == depth, "some tree reaches the deepest level"
