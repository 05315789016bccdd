"""Shared pytest setup: repo root on sys.path, single-threaded torch for stable CPU timings, a local Ray."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `mtpserve` and `tests.helpers` for modules and the children they start
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # run Triton kernels on CPU (numpy interpreter)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest-xdist workers share the cores
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray runtime (2 CPUs) for the tests of one module, shut down after them."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def kernels_in_force() -> Iterator[Callable[..., Any]]:
    """Put kernel choices (`KernelChoices` fields: pdl, gemv_tiles) in force for the rest of a test, for kernels
    called outside a model's run (a model's run puts its own in force)."""
    from mtpserve.modeling import kernel_choices

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(kernel_choices.in_force(kernel_choices.KernelChoices(**fields)))
