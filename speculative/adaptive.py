"""Adaptive speculation: each step's kind (a chain depth, or a draft tree) from the batch size, the step
costs and the running acceptance.

A chain of depth k emits 1 + P(n >= 1) + ... + P(n >= k) tokens per request and step on average, where n is
the number of drafts the target accepts; P(n >= j) does not depend on the depth as long as the depth is at
least j, because draft j is the same token however long the chain runs. A draft tree emits 1 + the nodes
accepted along its walked branch; its mean comes from the tree steps that ran (`TreeAcceptance`). A step's
cost depends on the batch bucket and the kind. The policy picks the kind with the most expected tokens per
second, never one below depth 0 (target-only: the draft re-runs over the step's row but proposes nothing,
so speculation can come back at any step without a gap in the draft's context).

Kinds the policy does not pick are measured only when it explores: every `explore_every` decisions it runs
another kind for `explore_steps` decisions, one depth deeper or shallower than a chosen chain or, in turn, the
tree (the deepest chain while a tree is chosen). The first of them verifies drafts proposed for the kind before
(padded, or reshaped: `speculative/draft_shapes.py`). A kind is explored only where it could win: its
most tokens per step (depth + 1) over its cost must beat the chosen kind's expected rate.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepKind:
    """What a speculative step verifies and proposes: a chain of `depth` drafts (0: none, the draft only keeps
    its KV), or, with `budget` > 0, a draft tree of `budget` nodes at most `depth` deep, each node with at
    most `width` children."""

    depth: int
    budget: int = 0
    width: int = 0

    @classmethod
    def tree(cls, depth: int, budget: int, width: int) -> StepKind:
        """A draft tree's kind."""
        if depth < 1 or budget < 1 or width < 1:
            raise ValueError(f"a tree needs depth, budget and width >= 1; got {depth}, {budget}, {width}")
        return cls(depth, budget, width)

    @property
    def is_tree(self) -> bool:
        """Whether the step verifies and proposes a draft tree."""
        return self.budget > 0

    @property
    def num_draft_tokens(self) -> int:
        """Drafts a request carries into the step (`StepPlan.num_draft_tokens`): the tree's budget, or the depth."""
        return self.budget or self.depth

    @property
    def most_tokens(self) -> int:
        """The most tokens a request can emit in one step: every draft along one branch, plus the bonus."""
        return self.depth + 1

    def __str__(self) -> str:
        return f"tree{self.budget}" if self.is_tree else str(self.depth)


@dataclass
class AcceptanceTracker:
    """Decayed estimates of P(accepted >= j) for draft positions j = 1..max_depth, over recent verify rows.

    Position j starts from prior**j (each further draft accepted with the same chance) with weight
    `prior_weight` rows; an observation at a position decays that position's earlier ones by half every
    `halflife` rows."""

    max_depth: int
    halflife: float = 256.0
    prior: float = 0.6
    prior_weight: float = 4.0
    hits: list[float] = field(init=False)
    tries: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.halflife <= 0 or not 0.0 <= self.prior <= 1.0 or self.prior_weight <= 0:
            raise ValueError("AcceptanceTracker needs max_depth >= 1, halflife > 0, prior in [0, 1], prior_weight > 0")
        self.hits = [self.prior ** (j + 1) * self.prior_weight for j in range(self.max_depth)]
        self.tries = [self.prior_weight] * self.max_depth
        self._decay = 0.5 ** (1.0 / self.halflife)

    def record(self, drafted: int, accepted: int) -> None:
        """Add one verify row that checked `drafted` real drafts and accepted `accepted` of them."""
        d = self._decay
        for j in range(min(drafted, self.max_depth)):
            self.tries[j] = self.tries[j] * d + 1.0
            self.hits[j] = self.hits[j] * d + float(j < accepted)

    def rates(self) -> list[float]:
        """P(accepted >= j) for j = 1..max_depth, made non-increasing (a longer prefix is never likelier)."""
        out: list[float] = []
        for h, t in zip(self.hits, self.tries, strict=True):
            r = h / t
            out.append(min(r, out[-1]) if out else r)
        return out

    def expected_tokens(self, depth: int) -> float:
        """Tokens a request emits per step on average with `depth` drafts."""
        return 1.0 + sum(self.rates()[:depth])


@dataclass
class TreeAcceptance:
    """Decayed mean of the tokens a draft tree's verify row emits (1 + the nodes accepted along its branch),
    over recent rows of real tree steps; each row halves the weight of the rows before it every `halflife`
    rows. Until rows come in, the mean leans on a prior that the caller gives (weight `prior_weight` rows,
    decaying with them)."""

    halflife: float = 256.0
    prior_weight: float = 4.0
    tokens: float = field(init=False, default=0.0)
    rows: float = field(init=False, default=0.0)
    weight: float = field(init=False)  # what is left of the prior's weight

    def __post_init__(self) -> None:
        if self.halflife <= 0 or self.prior_weight <= 0:
            raise ValueError("TreeAcceptance needs halflife > 0 and prior_weight > 0")
        self.weight = self.prior_weight
        self._decay = 0.5 ** (1.0 / self.halflife)

    def record(self, accepted: int) -> None:
        """Add one verify row of a tree step that accepted `accepted` nodes."""
        d = self._decay
        self.tokens = self.tokens * d + 1.0 + accepted
        self.rows = self.rows * d + 1.0
        self.weight *= d

    def expected_tokens(self, prior: float) -> float:
        """Tokens a request emits per tree step on average; `prior` stands in for rows not seen yet."""
        return (self.tokens + self.weight * prior) / (self.rows + self.weight)


KindLike = int | StepKind  # a chain depth, or any kind


class StepCosts:
    """Seconds per step by (batch bucket, kind): measured once (`set`; `online` False), or kept as a moving
    average of the engine's observed steps (`observe`; `online` True). Kinds are the chain depths 0..max_depth
    and the draft trees in `trees`.

    Timed costs measure the device's work alone. With steps launched ahead, what a step really costs is the period
    between steps in steady decoding: the longer of the host's work per step and the device's, and their
    overlap is never perfect. `observe_period` keeps that period per (bucket, kind) where the engine saw steps of
    one kind in a row; `get` returns it where seen, and elsewhere the timed cost scaled by how much the seen
    periods exceed their timed costs in that bucket. Example, SmolLM2 at batch 64 on one H100: timed 0.9 / 1.0 /
    1.2 ms at depth 1 / 2 / 3; depth 2 runs at a period of 1.32 ms (1.32x its timed cost), so depth 3 is
    estimated at 1.58 ms until it runs, and depth 1 at 1.19 ms."""

    def __init__(
        self,
        buckets: Sequence[int],
        max_depth: int,
        smoothing: float = 0.1,
        online: bool = True,
        trees: Sequence[StepKind] = (),
    ) -> None:
        if not buckets or max_depth < 0 or not 0.0 < smoothing <= 1.0:
            raise ValueError("StepCosts needs batch buckets, max_depth >= 0 and smoothing in (0, 1]")
        if any(not t.is_tree or t.budget <= max_depth for t in trees):
            raise ValueError(
                f"tree kinds need a budget above the deepest chain ({max_depth}), so that a step's draft count "
                f"names its kind; got {[str(t) for t in trees]}"
            )
        self.online = online
        self.buckets = sorted(set(buckets))
        self.max_depth = max_depth
        self.smoothing = smoothing
        self.trees = tuple(trees)
        self.seconds: dict[tuple[int, StepKind], float] = {}
        self.periods: dict[tuple[int, StepKind], float] = {}  # seconds between launched steps of one kind in a row

    def bucket(self, batch: int) -> int:
        """The bucket a batch of `batch` requests runs in (the largest one for bigger batches)."""
        i = bisect_left(self.buckets, max(1, batch))
        return self.buckets[min(i, len(self.buckets) - 1)]

    def set(self, bucket: int, kind: KindLike, seconds: float) -> None:
        """Record a measured cost."""
        key = (bucket, as_kind(kind))
        self._check(key, seconds)
        self.seconds[key] = seconds

    def observe(self, batch: int, kind: KindLike, seconds: float) -> None:
        """Fold one observed step of `batch` requests into its bucket's moving average."""
        key = (self.bucket(batch), as_kind(kind))
        self._check(key, seconds)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_period(self, batch: int, kind: KindLike, seconds: float) -> None:
        """Fold one steady period between launched steps of `kind` over `batch` requests into its moving average."""
        if not seconds > 0:
            return
        key = (self.bucket(batch), as_kind(kind))
        old = self.periods.get(key)
        self.periods[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def get(self, bucket: int, kind: KindLike) -> float | None:
        """The cost of a step: its observed period where seen, else its timed cost scaled by the bucket's seen
        periods over their timed costs (1 where none is seen); None when neither exists."""
        key = (bucket, as_kind(kind))
        seen = self.periods.get(key)
        if seen is not None:
            return seen
        timed = self.seconds.get(key)
        if timed is None:
            return None
        ratios = [p / self.seconds[k] for k, p in self.periods.items() if k[0] == bucket and k in self.seconds]
        return timed * (sum(ratios) / len(ratios)) if ratios else timed

    def _check(self, key: tuple[int, StepKind], seconds: float) -> None:
        bucket, kind = key
        known = kind in self.trees if kind.is_tree else 0 <= kind.depth <= self.max_depth
        if bucket not in self.buckets or not known or not seconds > 0:
            trees = f" or a tree in {[str(t) for t in self.trees]}" if self.trees else ""
            raise ValueError(
                f"a step cost needs a bucket in {self.buckets}, a depth in [0, {self.max_depth}]{trees} and "
                f"seconds > 0; got bucket {bucket}, kind {kind}, seconds {seconds}"
            )


def as_kind(kind: KindLike) -> StepKind:
    """A chain depth as its kind; a kind as itself."""
    return kind if isinstance(kind, StepKind) else StepKind(kind)


class AdaptiveDepth:
    """Chooses each step's kind: a chain depth in [0, max_depth] or one of the costs' draft trees, the one with
    the most expected tokens per second for the batch's bucket, keeping the current kind unless another is
    better by more than `margin` (and never keeping one below depth 0)."""

    def __init__(
        self,
        costs: StepCosts,
        tracker: AcceptanceTracker,
        explore_every: int = 64,
        explore_steps: int = 3,
        margin: float = 0.03,
    ) -> None:
        if costs.max_depth != tracker.max_depth:
            raise ValueError("the step costs and the acceptance tracker need the same max_depth")
        if explore_every < 1 or explore_steps < 0 or margin < 0:
            raise ValueError("AdaptiveDepth needs explore_every >= 1, explore_steps >= 0 and margin >= 0")
        self.costs, self.tracker = costs, tracker
        self.max_depth = tracker.max_depth
        self.explore_every, self.explore_steps, self.margin = explore_every, explore_steps, margin
        self.trees = {t: TreeAcceptance(tracker.halflife) for t in costs.trees}
        self.kinds = [StepKind(d) for d in range(self.max_depth + 1)] + list(costs.trees)
        self.kind = StepKind(self.max_depth)  # the kind chosen last (exploration aside)
        self.decisions = 0
        self.steps_per_kind = dict.fromkeys(self.kinds, 0)

    @property
    def depth(self) -> int:
        """The depth of the kind chosen last (a tree's depth for a tree)."""
        return self.kind.depth

    @property
    def steps_per_depth(self) -> list[int]:
        """Steps run so far at each chain depth 0..max_depth."""
        return [self.steps_per_kind[StepKind(d)] for d in range(self.max_depth + 1)]

    @property
    def tree_steps(self) -> int:
        """Steps run so far as draft trees."""
        return sum(self.steps_per_kind[t] for t in self.trees)

    def step_counts(self) -> dict[str, int]:
        """Steps run so far by kind ('0'..'K' for chains, 'tree<budget>' for trees)."""
        return {str(k): n for k, n in self.steps_per_kind.items()}

    def kind_of(self, num_draft_tokens: int) -> StepKind:
        """The kind of a step whose requests carry `num_draft_tokens` drafts (a tree's budget, or a depth)."""
        return next((t for t in self.trees if t.budget == num_draft_tokens), StepKind(num_draft_tokens))

    def expected_tokens(self, kind: KindLike) -> float:
        """Tokens a request emits per step on average with `kind`. A tree's prior is the chain of its depth
        (its first branch is about that chain)."""
        kind = as_kind(kind)
        if not kind.is_tree:
            return self.tracker.expected_tokens(kind.depth)
        prior = self.tracker.expected_tokens(min(kind.depth, self.max_depth))
        return self.trees[kind].expected_tokens(prior)

    def throughput(self, batch: int, kind: KindLike) -> float | None:
        """Expected tokens per second per request with `kind` for a batch of `batch`; None if unmeasured."""
        cost = self.costs.get(self.costs.bucket(batch), kind)
        return None if cost is None else self.expected_tokens(kind) / cost

    def best(self, batch: int) -> StepKind:
        """The kind with the most expected tokens per second (an unmeasured kind first, to measure it), with
        the current kind kept within `margin` of the best as long as it is not below depth 0."""
        scores: dict[StepKind, float] = {}
        for kind in self.kinds:
            score = self.throughput(batch, kind)
            if score is None:
                return kind
            scores[kind] = score
        top = max(scores, key=lambda k: (scores[k], k.num_draft_tokens))
        current = scores.get(self.kind, 0.0)
        if current >= scores[StepKind(0)] and current >= scores[top] * (1.0 - self.margin):
            return self.kind
        return top

    def choose(self, batch: int) -> StepKind:
        """This step's kind for a batch of `batch` generation requests (counts the decision)."""
        self.decisions += 1
        kind = self.kind = self.best(batch)
        if self.explore_steps and self.decisions % self.explore_every < self.explore_steps:
            kind = self._explore(batch, kind)
        self.steps_per_kind[kind] += 1
        return kind

    def _explore(self, batch: int, best: StepKind) -> StepKind:
        """The kind an exploring decision runs instead of `best` (`best` itself when none could win): one
        depth deeper or shallower than a chain, or a tree; the deepest chain while a tree is best. Where several
        apply, successive exploring cycles take them in turn."""
        options: list[StepKind] = []
        if best.is_tree:
            options.append(StepKind(self.max_depth))
        else:
            options += [StepKind(d) for d in (best.depth + 1, best.depth - 1) if 0 <= d <= self.max_depth]
        cycle = self.decisions // self.explore_every
        others = [t for t in self.trees if t != best]
        if others:
            options.append(others[(cycle // 2) % len(others)])
        options = [k for k in options if self._could_win(batch, k, best)]
        return options[cycle % len(options)] if options else best

    def _could_win(self, batch: int, kind: StepKind, best: StepKind) -> bool:
        """Whether `kind`, accepting every draft along a branch, would beat `best`'s expected rate."""
        cost, rate = self.costs.get(self.costs.bucket(batch), kind), self.throughput(batch, best)
        return cost is None or rate is None or kind.most_tokens / cost > rate

    def record(self, kind: KindLike, drafted: int, accepted: int, reshaped: bool = False) -> None:
        """Add one verify row of a step of `kind`: a chain row that checked `drafted` real drafts, or a tree
        row; a tree row whose drafts were reshaped from another kind's (`reshaped`) says nothing about trees."""
        kind = as_kind(kind)
        if kind.is_tree:
            if not reshaped:
                self.trees[kind].record(accepted)
        elif drafted:
            self.tracker.record(drafted, accepted)
