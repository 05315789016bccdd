"""The adaptive policy over chain depths and a draft tree (fake costs and acceptance), and the reshaping of
stored drafts when the step kind changes."""

from __future__ import annotations

import pytest
import torch

from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind, TreeAcceptance
from mtpserve.speculative.draft_shapes import chain_as_tree, first_branch, fit_drafts
from mtpserve.speculative.tree import DraftTree

K = 3
TREE = StepKind.tree(3, 16, 4)


def policy_over(
    table: dict[int, list[float]], rates: list[float], tree_tokens: float | None = None, **kw: float
) -> AdaptiveDepth:
    """A policy with costs [depth 0..K, tree] per bucket, chain acceptance of these tail rates, and (given) a
    tree that emitted `tree_tokens` per row over many rows."""
    costs = StepCosts(sorted(table), K, online=False, trees=[TREE])
    for bucket, row in table.items():
        for d, c in enumerate(row[:-1]):
            costs.set(bucket, d, c)
        costs.set(bucket, TREE, row[-1])
    tracker = AcceptanceTracker(K, halflife=1e9, prior_weight=1e-9)
    for _ in range(200):
        for j, (hi, lo) in enumerate(zip(rates, [*rates[1:], 0.0], strict=True)):
            for _ in range(round((hi - lo) * 100)):
                tracker.record(K, j + 1)
        for _ in range(round((1 - rates[0]) * 100)):
            tracker.record(K, 0)
    policy = AdaptiveDepth(costs, tracker, **kw)  # type: ignore[arg-type]
    if tree_tokens is not None:
        for _ in range(5000):
            policy.record(TREE, 3, round(tree_tokens) - 1)
    return policy


def brute_force(policy: AdaptiveDepth, bucket: int) -> StepKind:
    """argmax over every kind of expected tokens / cost."""
    return max(policy.kinds, key=lambda k: policy.expected_tokens(k) / policy.costs.get(bucket, k))  # type: ignore[operator]


def test_the_tree_wins_where_its_cost_per_expected_token_is_lowest() -> None:
    """A tree emitting 4 tokens per step at 1.35x a target step beats every chain at batch 1 (Llama-8B-like
    costs); at batch 64, where it costs 4x, chains win; each pick is the brute-force argmax."""
    table = {1: [1.0, 1.1, 1.2, 1.3, 1.35], 64: [1.0, 1.3, 1.6, 1.9, 4.0]}
    policy = policy_over(table, [0.8, 0.6, 0.4], tree_tokens=4.0, explore_steps=0, margin=0.0)
    assert policy.expected_tokens(TREE) == pytest.approx(4.0, abs=1e-3)
    assert policy.choose(1) == TREE == brute_force(policy, 1)
    pick = policy.choose(64)
    assert not pick.is_tree and pick == brute_force(policy, 64)
    assert policy.tree_steps == 1 and sum(policy.steps_per_depth) == 1
    assert policy.step_counts()["tree16"] == 1


def test_target_only_when_speculation_does_not_pay() -> None:
    """With low acceptance, and a tree that accepts well but costs 5x a target step (SmolLM2 on one H200),
    depth 0 is chosen; and a kind within the margin of the best but below depth 0 is not kept."""
    table = {1: [1.0, 1.4, 1.8, 2.2, 5.0]}
    policy = policy_over(table, [0.2, 0.05, 0.01], tree_tokens=3.5, explore_steps=0, margin=0.5)
    policy.kind = StepKind(1)  # 1.2 / 1.4 tokens per second: within 50 % of depth 0, but below it
    assert policy.choose(1) == StepKind(0)
    assert policy.choose(1) == StepKind(0)


def test_the_tree_is_explored_where_it_could_win_and_taken_once_it_does() -> None:
    """Before any tree step the tree's expected tokens are the chain's at its depth, so it is not chosen; exploring
    cycles run, in turn, one depth shallower (nothing is deeper) and the tree; once the tree is recorded emitting 4
    tokens it is chosen. A tree whose most tokens per step (depth + 1) cannot beat the best rate is never run, not
    even to explore."""
    table = {1: [1.0, 1.1, 1.2, 1.3, 1.6]}
    policy = policy_over(table, [0.6, 0.4, 0.2], explore_every=8, explore_steps=2, margin=0.0)
    assert policy.expected_tokens(TREE) == pytest.approx(policy.expected_tokens(3))
    picks = [policy.choose(1) for _ in range(40)]
    assert policy.kind == StepKind(3)  # the best: nothing deeper, so depth 2 and the tree are explored
    explored = [StepKind(2), TREE]
    assert picks == [explored[(i // 8) % 2] if i % 8 < 2 else StepKind(3) for i in range(1, 41)]
    for _ in range(2000):
        policy.record(TREE, 3, 3)
    assert policy.best(1) == TREE
    costly = policy_over({1: [1.0, 1.1, 1.2, 1.3, 4.5]}, [0.6, 0.4, 0.2], explore_every=4, explore_steps=2)
    assert TREE not in {costly.choose(1) for _ in range(40)}


def test_while_the_tree_is_chosen_the_deepest_chain_is_explored() -> None:
    """Exploring while the tree is best runs depth K, which refreshes every chain position's acceptance."""
    table = {1: [1.0, 1.1, 1.2, 1.3, 1.35]}
    policy = policy_over(table, [0.8, 0.6, 0.4], tree_tokens=4.0, explore_every=4, explore_steps=1, margin=0.0)
    picks = [policy.choose(1) for _ in range(12)]
    assert picks == [StepKind(3) if i % 4 < 1 else TREE for i in range(1, 13)]


def test_tree_acceptance_is_a_decayed_mean_over_a_prior() -> None:
    """No rows: the prior; rows pull the mean to them, recent rows weighing more."""
    acc = TreeAcceptance(halflife=8, prior_weight=4)
    assert acc.expected_tokens(2.0) == pytest.approx(2.0)
    for _ in range(100):
        acc.record(3)
    assert acc.expected_tokens(2.0) == pytest.approx(4.0, abs=1e-3)
    for _ in range(8):
        acc.record(0)
    assert acc.expected_tokens(2.0) == pytest.approx(2.5, abs=0.01)  # half the weight on the 8 new rows


def test_kinds_are_named_by_their_draft_count() -> None:
    """A tree's budget must exceed the deepest chain, so a step's draft count says which kind it is."""
    policy = policy_over({1: [1.0] * 5}, [0.5, 0.2, 0.1])
    assert policy.kind_of(16) == TREE and policy.kind_of(2) == StepKind(2)
    with pytest.raises(ValueError, match="budget above the deepest chain"):
        StepCosts([1], 3, trees=[StepKind.tree(3, 3, 2)])
    with pytest.raises(ValueError, match="tree16"):
        StepCosts([1], 3).set(1, TREE, 1.0)


# ---- reshaping stored drafts -----------------------------------------------------------------------


def check_tree(tokens: list[int], parents: list[int], kind: StepKind) -> DraftTree:
    """The drafts form a valid tree of the kind's budget, depth and width (distinct siblings)."""
    tree = DraftTree.from_drafts([0, *tokens], parents)
    assert tree.size == kind.budget + 1
    assert int(tree.depth().max()) <= kind.depth
    assert max(len(tree.children(i)) for i in range(tree.size)) <= kind.width
    return tree


@pytest.mark.parametrize("chain", [[], [7], [7, 8, 9], [5, 5, 5]])
@pytest.mark.parametrize("kind", [StepKind.tree(3, 16, 4), StepKind.tree(3, 6, 2), StepKind.tree(2, 5, 3)])
def test_a_chain_padded_into_a_tree_keeps_it_as_the_first_branch(chain: list[int], kind: StepKind) -> None:
    tokens, parents = chain_as_tree(chain, kind.budget, kind.depth, kind.width)
    check_tree(tokens, parents, kind)
    assert first_branch(tokens, parents)[: len(chain[: kind.depth])] == chain[: kind.depth]


def test_a_tree_too_small_for_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 7 nodes"):
        chain_as_tree([1, 2], 7, 2, 2)


def test_stored_drafts_fit_each_kind() -> None:
    """Chains cut or pad (counting the real drafts); a tree gives a chain its first branch; a chain becomes
    a padded tree (a reshaped row: its real drafts counted); a tree of the budget stays as it is."""
    assert fit_drafts([1, 2, 3], None, StepKind(2), 9) == ([1, 2], None, None)
    assert fit_drafts([1], None, StepKind(3), 9) == ([1, 9, 9], None, 1)
    tree_tokens, tree_parents = [4, 5, 6, 7, 8], [0, 0, 1, 1, 3]  # first branch 4 -> 6 -> 8
    assert first_branch(tree_tokens, tree_parents) == [4, 6, 8]
    assert fit_drafts(tree_tokens, tree_parents, StepKind(2), 9) == ([4, 6], None, None)
    kind = StepKind.tree(3, 5, 2)
    assert fit_drafts(tree_tokens, tree_parents, kind, 9) == (tree_tokens, tree_parents, None)
    tokens, parents, real = fit_drafts([1, 2], None, kind, 9)
    assert real == 2 and first_branch(tokens, parents)[:2] == [1, 2]
    check_tree(tokens, parents, kind)
    tokens, parents, real = fit_drafts(tree_tokens, tree_parents, StepKind.tree(3, 8, 2), 9)
    assert real == 3 and first_branch(tokens, parents)[:3] == [4, 6, 8]
    assert torch.equal(check_tree(tokens, parents, StepKind.tree(3, 8, 2)).tokens[1:4], torch.tensor([4, 6, 8]))
