"""How the small-step Triton kernels launch (`KernelChoices`: PDL on or off, matrix-vector tiles per row count),
held by each model and in force while that model runs or is captured, so two engines in one process may choose
differently. Outside any model's run the defaults hold: PDL on where the device allows, default tiles."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from mtpserve.modeling.gemv_tiles import GemvTiles


@dataclass(frozen=True)
class KernelChoices:
    """One model's launch choices: `pdl` (`modeling/pdl.py`) and the matrix-vector `gemv_tiles` by padded row
    count (`modeling/gemv_tiles.py`; empty: the default tiles)."""

    pdl: bool = True
    gemv_tiles: Mapping[int, GemvTiles] = field(default_factory=dict)


DEFAULT = KernelChoices()
_CURRENT: ContextVar[KernelChoices | None] = ContextVar("kernel_choices", default=None)


def current() -> KernelChoices:
    """The choices in force here (this thread or task)."""
    return _CURRENT.get() or DEFAULT


@contextmanager
def in_force(choices: KernelChoices) -> Iterator[None]:
    """Put `choices` in force for the kernels launched (or captured) inside the block."""
    token = _CURRENT.set(choices)
    try:
        yield
    finally:
        _CURRENT.reset(token)
