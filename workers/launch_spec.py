"""What a runner can queue on the device ahead of reading it (`LaunchSpec`), and a launched step (`LaunchedStep`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.speculative.messages import StepPlan
from mtpserve.workers.graph_runner import uniform_bucket


@dataclass(frozen=True)
class LaunchSpec:
    """Which plans `TargetRunner.launch` queues ahead: generation steps of a draft depth d in `depths`,
    of d + 1 rows per sequence, within `max_blocks[i]` blocks (depths[i] = d) and the captured batch
    `sizes`; and, with `tree_budget` > 0, tree steps (every sequence a tree of that many drafts) within
    `tree_max_blocks` blocks and `tree_sizes`. A scheduler in another process predicts the runner's choice
    from it."""

    depths: tuple[int, ...]
    max_blocks: tuple[int, ...]
    sizes: tuple[int, ...]
    tree_budget: int = 0
    tree_max_blocks: int = 0
    tree_sizes: tuple[int, ...] = ()

    def is_tree(self, plan: StepPlan) -> bool:
        """Whether `launch` would take `plan` as a tree step (its draft count is the tree's budget)."""
        return self.tree_budget > 0 and plan.num_draft_tokens == self.tree_budget

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The captured batch bucket `launch` would use for `plan`; None when it would not launch it."""
        if any(s.processing is not None for s in plan.seqs):  # logit rules and logprobs run eagerly
            return None
        d = plan.num_draft_tokens
        if self.is_tree(plan):
            return uniform_bucket(plan, d + 1, self.tree_max_blocks, self.tree_sizes, trees=True)
        if d not in self.depths:
            return None
        return uniform_bucket(plan, d + 1, self.max_blocks[self.depths.index(d)], self.sizes)


@dataclass
class LaunchedStep:
    """A generation step launched on the device whose tokens are not read yet."""

    plan: StepPlan
    results: torch.Tensor  # device [m, W]: this step's packed results, which the next launch may read
    host: torch.Tensor  # [m, W] the same on the host; valid once `ready` has completed
    ready: torch.cuda.Event | None  # recorded after the copy to `host` (None off CUDA)
    tree: bool = False  # launched on the tree step (its results are laid out as `ResultColumns`)
    chunks: int = 0  # leading prompt chunks of requests that joined in it (`joined_step.py`)
