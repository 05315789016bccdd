"""The fixed-shape steps a target runner replays (`CapturedSteps`), given to it when it is built, and what each
kind of step offers (`CapturedStep`, `LaunchableStep`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mtpserve.speculative.messages import StepPlan, TargetOutput
from mtpserve.workers.fused_step import FusedDepthSteps, FusedSpecStep
from mtpserve.workers.prefill_step import CapturedPrefill
from mtpserve.workers.tree_step import FusedTreeStep
from mtpserve.workers.uniform_step import UniformTargetStep


class CapturedStep(Protocol):
    """A step captured per batch bucket that runs a whole plan: the chain steps (one depth or every depth), the
    tree step and the prefill step."""

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The captured bucket that takes `plan`; None when this step cannot run it."""
        ...

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """Replay the bucket for `plan` and read its tokens (and drafts); `keys` are the requests' sampling keys,
        None for an all-greedy step."""
        ...


class LaunchableStep(CapturedStep, Protocol):
    """A captured step that can be launched before the one ahead of it is read: chain and tree steps."""

    def launch(
        self, plan: StepPlan, bucket: int, keys: list[int] | None = None, after: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Replay without waiting; the device results of the real rows (inputs from `after`'s results when
        given)."""
        ...

    def read(self, plan: StepPlan, host: torch.Tensor) -> TargetOutput:
        """The step's output from its results, copied to the host."""
        ...


@dataclass(frozen=True)
class CapturedSteps:
    """Every captured step of one target runner; a missing one runs its plans eagerly (or through another).

    On CUDA with graphs, an in-process engine drafting a K=3 chain holds `target` (Q = 4 rows a request, for
    steps the chain cannot take), `chain` (target, verify and the next 3 drafts in one replay) and `prefill`
    (a lone prompt chunk with the draft's KV update); adaptive over a tree adds `tree`. Off CUDA all are None."""

    target: UniformTargetStep | None = None  # target-only rows (Q = 1), or verify rows with the draft apart
    chain: FusedSpecStep | FusedDepthSteps | None = None  # the draft's chain folded in, per depth when adaptive
    tree: FusedTreeStep | None = None  # a colocated tree drafter folded in
    prefill: CapturedPrefill | None = None  # a lone request's prompt chunk

    def max_batch(self) -> int:
        """The largest batch the captured generation steps take."""
        step = next(s for s in (self.chain, self.tree, self.target) if s is not None)
        return int(step.buffers.max_batch)

    def generation(self) -> list[CapturedStep]:
        """The steps that run whole generation plans, in the order a plan tries them: tree, then chain."""
        return [s for s in (self.tree, self.chain) if s is not None]

    def chain_steps(self) -> list[FusedSpecStep]:
        """The chain's step of each depth, shallowest first (none without a chain)."""
        if self.chain is None:
            return []
        by_depth = self.chain.depth_steps()
        return [by_depth[d] for d in sorted(by_depth)]
