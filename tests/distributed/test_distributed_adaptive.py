"""Adaptive speculation through Ray actors (scheduler + 2 TP target workers, the draft on its own worker or
in rank 0): the kind of each step travels in its plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.distributed.build import build_engine
from tests.distributed.test_distributed import dist_config
from tests.helpers.tiny import draft_kv, mimic_head, mimic_target, random_prompts, save_mimic, tiny_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The mimic target as an HF directory and its head as a file."""
    return save_mimic(tmp_path_factory.mktemp("mimic"))


def run_noting_proposals(
    eng: Any, prompts: list[list[int]], params: list[dict[str, Any]]
) -> tuple[list[list[int]], set[tuple[int, int, bool]]]:
    """Run the requests to the end: their tokens in order, and (drafts asked, drafts proposed, a tree) of
    every step that proposed."""
    proposed: set[tuple[int, int, bool]] = set()
    update = eng.scheduler.update

    def noted(plan: Any, out: Any, drafts: Any) -> Any:
        if drafts is not None and drafts.request_ids:
            shape = drafts.draft_token_ids.shape[1], drafts.draft_parents is not None
            proposed.add((plan.num_draft_tokens, *shape))
        return update(plan, out, drafts)

    eng.scheduler.update = noted
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id].extend(o.new_token_ids)
    return [tokens[r] for r in ids], proposed


def target_only(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[list[int]]:
    """The mimic target's own tokens for each request."""
    args, w = mimic_target()
    ref = tiny_engine(args, w)
    return [ref.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_adaptive_depths_through_actors(ray_local, model, placement: str) -> None:
    """Adaptive speculation over Ray: depth 0 at three or more requests (the draft worker only writes its KV),
    1 at two and 3 alone, the depth travelling in each plan; same tokens as target-only, drafts accepted."""
    from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts

    prompts = random_prompts(4, 96, [15, 4, 30, 9], seed=16)
    params = [{"max_tokens": m} for m in (24, 6, 12, 18)]
    cfg = dist_config(model, placement, chunk_size=5)
    cfg.speculative.adaptive = True
    eng = build_engine(cfg)
    try:
        assert eng.scheduler.depth is not None and eng.scheduler.depth.costs.online
        costs = StepCosts([1, 2, 4, 8], 3, online=False)
        for bucket, want in {1: 3, 2: 1, 4: 0, 8: 0}.items():
            for d in range(4):
                costs.set(bucket, d, 1.0 if d == want else 100.0)
        eng.scheduler.depth = policy = AdaptiveDepth(costs, AcceptanceTracker(3), explore_steps=0)
        tokens, _ = run_noting_proposals(eng, prompts, params)
        assert tokens == target_only(prompts, params)
        assert policy.steps_per_depth[0] > 0 and policy.steps_per_depth[3] > 0, policy.steps_per_depth
        assert eng.totals.accepted > 0
        if placement == "separate":  # depth 0 still wrote the draft worker's KV: it equals a fixed-K run's
            import ray

            costs.set(2, 0, 1.0)
            costs.set(2, 1, 100.0)  # two requests now run at depth 0, one alone at depth 3
            pair = random_prompts(2, 96, [13, 7], seed=9)
            args, w = mimic_target()
            a, _ = (eng.add_request(p, {"max_tokens": m}) for p, m in zip(pair, (40, 12), strict=True))
            fixed = tiny_engine(args, w, mimic_head(args, w), speculative={"num_draft_tokens": 3})
            fa, _ = (fixed.add_request(p, {"max_tokens": m}) for p, m in zip(pair, (40, 12), strict=True))
            until = len(pair[0]) + 30
            for e, r in ((eng, a), (fixed, fa)):
                while e.scheduler.requests[r].num_computed_tokens < until:
                    e.step()
            n = min(eng.scheduler.requests[a].num_computed_tokens, fixed.scheduler.requests[fa].num_computed_tokens)
            group = eng.target.group  # type: ignore[attr-defined]
            got = ray.get(group.draft.draft_kv.remote(eng.scheduler.requests[a].block_ids, n))
            torch.testing.assert_close(got, draft_kv(fixed, fa, n), atol=1e-5, rtol=1e-5)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_adaptive_trees_through_actors(ray_local, model, placement: str) -> None:
    """Adaptive over chains and an 8-node tree over Ray: the tree alone and at three or four requests, depth 1
    at two; the step's draft count tells rank 0's drafter (or the draft worker) which kind to propose, and the
    rows carry their trees; same tokens as target-only, both kinds run."""
    from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind

    prompts = random_prompts(4, 96, [15, 4, 30, 9], seed=16)
    params = [{"max_tokens": m} for m in (24, 6, 12, 18)]
    cfg = dist_config(model, placement, chunk_size=5)
    cfg.speculative.tree_budget, cfg.speculative.tree_width = 8, 3
    cfg.speculative.adaptive = True
    eng = build_engine(cfg)
    try:
        built = eng.scheduler.depth
        assert built is not None and built.costs.online and [str(t) for t in built.costs.trees] == ["tree8"]
        tree = built.costs.trees[0]
        costs = StepCosts([1, 2, 4, 8], 3, online=False, trees=[tree])
        for bucket, want in {1: tree, 2: StepKind(1), 4: tree, 8: StepKind(0)}.items():
            for kind in built.kinds:
                costs.set(bucket, kind, 1.0 if kind == want else 100.0)
        eng.scheduler.depth = policy = AdaptiveDepth(costs, AcceptanceTracker(3), explore_steps=0)
        tokens, proposed = run_noting_proposals(eng, prompts, params)
        assert tokens == target_only(prompts, params)
        assert policy.tree_steps > 3 and policy.steps_per_depth[1] > 0, policy.step_counts()
        assert {(8, 8, True), (1, 1, False)} <= proposed and all((n == 8) == t for n, _, t in proposed), proposed
        assert eng.totals.accepted > 0
    finally:
        eng.shutdown()
