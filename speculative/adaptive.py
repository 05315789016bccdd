"""Adaptive speculation: the draft depth of each step, from the batch size and the running acceptance.

A chain of depth k emits 1 + P(n >= 1) + ... + P(n >= k) tokens per request and step on average, where n is
the number of drafts the target accepts; P(n >= j) does not depend on the depth as long as the depth is at
least j, because draft j is the same token however long the chain runs. A step's cost depends on the batch
bucket and the depth. The policy picks the depth with the most expected tokens per second; depth 0 keeps the
draft's KV cache current (the draft re-runs over the step's row) but proposes nothing, so speculation can
come back at any step without a gap in the draft's context.

Positions past the chosen depth are measured only when the policy explores: every `explore_every`
decisions it runs one depth deeper for `explore_steps` decisions (the first of them verifies a padded draft,
since the step before proposed one draft fewer).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field


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


class StepCosts:
    """Seconds per step by (batch bucket, draft depth): measured once (`set`; `online` False), or kept as a
    moving average of the engine's observed steps (`observe`; `online` True)."""

    def __init__(self, buckets: Sequence[int], max_depth: int, smoothing: float = 0.1, online: bool = True) -> None:
        if not buckets or max_depth < 0 or not 0.0 < smoothing <= 1.0:
            raise ValueError("StepCosts needs batch buckets, max_depth >= 0 and smoothing in (0, 1]")
        self.online = online
        self.buckets = sorted(set(buckets))
        self.max_depth = max_depth
        self.smoothing = smoothing
        self.seconds: dict[tuple[int, int], float] = {}

    def bucket(self, batch: int) -> int:
        """The bucket a batch of `batch` requests runs in (the largest one for bigger batches)."""
        i = bisect_left(self.buckets, max(1, batch))
        return self.buckets[min(i, len(self.buckets) - 1)]

    def set(self, bucket: int, depth: int, seconds: float) -> None:
        """Record a measured cost."""
        self._check(bucket, depth, seconds)
        self.seconds[(bucket, depth)] = seconds

    def observe(self, batch: int, depth: int, seconds: float) -> None:
        """Fold one observed step of `batch` requests into its bucket's moving average."""
        key = (self.bucket(batch), depth)
        self._check(key[0], depth, seconds)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def get(self, bucket: int, depth: int) -> float | None:
        """The cost of a step, or None when it was never measured."""
        return self.seconds.get((bucket, depth))

    def _check(self, bucket: int, depth: int, seconds: float) -> None:
        if bucket not in self.buckets or not 0 <= depth <= self.max_depth or not seconds > 0:
            raise ValueError(
                f"a step cost needs a bucket in {self.buckets}, a depth in [0, {self.max_depth}] and seconds > 0; "
                f"got bucket {bucket}, depth {depth}, seconds {seconds}"
            )


class AdaptiveDepth:
    """Chooses each step's draft depth in [0, max_depth]: the one with the most expected tokens per second
    for the batch's bucket, keeping the current depth unless another is better by more than `margin`."""

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
        self.depth = self.max_depth
        self.decisions = 0
        self.steps_per_depth = [0] * (self.max_depth + 1)

    def throughput(self, batch: int, depth: int) -> float | None:
        """Expected tokens per second per request at `depth` for a batch of `batch`; None if unmeasured."""
        cost = self.costs.get(self.costs.bucket(batch), depth)
        return None if cost is None else self.tracker.expected_tokens(depth) / cost

    def best(self, batch: int) -> int:
        """The depth with the most expected tokens per second (an unmeasured depth first, to measure it),
        with the current depth kept within `margin` of the best."""
        scores: dict[int, float] = {}
        for depth in range(self.max_depth + 1):
            score = self.throughput(batch, depth)
            if score is None:
                return depth
            scores[depth] = score
        top = max(scores, key=lambda d: (scores[d], d))
        if scores.get(self.depth, 0.0) >= scores[top] * (1.0 - self.margin):
            return self.depth
        return top

    def choose(self, batch: int) -> int:
        """This step's depth for a batch of `batch` generation requests (counts the decision)."""
        self.decisions += 1
        depth = self.best(batch)
        self.depth = depth
        if self.explore_steps and depth < self.max_depth and self.decisions % self.explore_every < self.explore_steps:
            depth += 1
        self.steps_per_depth[depth] += 1
        return depth
