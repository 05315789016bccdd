"""The training schedule's arithmetic: the learning-rate factor at a step, and when a budgeted run re-sizes."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def next_replan(step: int, run_start: int) -> int:
    """The step at which a budgeted run next re-sizes its schedule: four times as far into this run as now."""
    return run_start + 4 * (step - run_start)
