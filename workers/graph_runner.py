"""CUDA-graph capture of fixed-shape steps over fixed-address buffers, bucketed by batch size.

On CUDA each bucket is captured once and replayed; elsewhere the same function runs eagerly on the
same buffers, so the buffer, padding and bucket logic is exercised by CPU tests too.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from mtpserve.speculative.messages import StepPlan
from mtpserve.speculative.sampling import SamplingMode

log = logging.getLogger(__name__)
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def capture_sizes(max_batch: int) -> list[int]:
    """The batch buckets to capture: the standard sizes below `max_batch`, plus `max_batch` itself."""
    return sorted({s for s in CAPTURE_SIZES if s < max_batch} | {max_batch})


def pick_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size that holds n sequences, or None (fall back to eager)."""
    for s in sorted(sizes):
        if s >= n:
            return s
    return None


def uniform_bucket(
    plan: StepPlan, q_len: int, max_blocks: int, sizes: Sequence[int], trees: bool = False
) -> int | None:
    """The captured batch size for a plan whose requests are all generation rows of `q_len` tokens with
    one-hot drafts (and, with `trees`, each a draft tree; otherwise none) within `max_blocks` blocks; None
    when any request is not, or nothing is planned."""
    if not plan.seqs:
        return None
    for s in plan.seqs:
        if s.is_context or len(s.token_ids) != q_len or len(s.block_ids) > max_blocks:
            return None
        if s.draft_probs is not None or (s.draft_parents is not None) != trees:
            return None
    return pick_bucket(len(plan.seqs), sizes)


class CapturedSteps:
    """One CUDA graph per batch bucket for `fn(bucket)`, sharing a memory pool; eager off CUDA.

    `fn` must read only fixed-address buffers and return tensors (their storage is reused per replay).
    """

    keep_graphs = False  # probes only: graphs captured from now on keep their nodes for `CUDAGraph.debug_dump`

    def __init__(self, fn: Callable[[int], Any], sizes: Sequence[int], device: torch.device, enabled: bool = True):
        self.fn = fn
        self.sizes = sorted(sizes)
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.replays = 0
        self.pool: Any = None  # the memory pool of the captured graphs (None before capture)

    def capture(self, pool: Any = None) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its pool (or `pool`, another
        CapturedSteps' pool: safe because a step's outputs are consumed before the next replay is launched).
        The garbage collector is paused meanwhile: collecting an unreachable graph during a capture
        invalidates the capture."""
        if not self.enabled:
            return
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all(pool)
        finally:
            if was_enabled:
                gc.enable()

    def _capture_all(self, pool: Any) -> None:
        stream = torch.cuda.Stream(self.device)
        for size in sorted(self.sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.fn(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph(keep_graph=self.keep_graphs)  # kept: its nodes stay for debug_dump
            if self.keep_graphs:
                graph.enable_debug_mode()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self.fn(size)
            if self.keep_graphs:
                graph.instantiate()
            pool = graph.pool()
            self.graphs[size] = graph
        self.pool = pool
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for batch sizes %s", self.sizes)

    def try_capture(self, pool: Any = None) -> bool:
        """Capture, or on failure drop to eager replay of the same function (logged); returns success."""
        try:
            self.capture(pool)
            return True
        except Exception:
            log.exception("CUDA-graph capture failed; these steps run eagerly")
            self.graphs.clear()
            self.outputs.clear()
            self.enabled = False
            if torch.cuda.is_available():
                torch.cuda.synchronize(self.device)
            return False

    def run(self, size: int) -> Any:
        """Replay (or run eagerly) the bucket `size`."""
        graph = self.graphs.get(size)
        if graph is None:
            return self.fn(size)
        graph.replay()
        self.replays += 1
        return self.outputs[size]


def _bind_mode(fn: Callable[[int, SamplingMode], Any], mode: SamplingMode, bucket: int) -> Any:
    return fn(bucket, mode)


class GreedyAndSampledSteps:
    """The captured variants of a uniform generation step, one per `SamplingMode`: all-greedy; sampling
    with temperature only; sampling with top-k/top-p too (temperature, top-k, top-p and thresholds read from
    fixed buffers). A sampling variant that cannot be captured runs eagerly over the same buffers."""

    def __init__(
        self,
        fn: Callable[[int, SamplingMode], Any],
        sizes: Sequence[int],
        device: torch.device,
        enabled: bool = True,
    ):
        self.variants = {
            mode: CapturedSteps(partial(_bind_mode, fn, mode), sizes, device, enabled) for mode in SamplingMode
        }

    @property
    def greedy(self) -> CapturedSteps:
        """The all-greedy variant."""
        return self.variants[SamplingMode.GREEDY]

    @property
    def sizes(self) -> list[int]:
        """The batch buckets."""
        return self.greedy.sizes

    @property
    def replays(self) -> int:
        """CUDA-graph replays so far (every variant)."""
        return sum(v.replays for v in self.variants.values())

    def capture(self) -> None:
        """Capture every variant for every bucket (CUDA only), all in one memory pool."""
        self.greedy.capture()
        self._capture_sampling()

    def try_capture(self) -> None:
        """`capture`, where a greedy variant that cannot be captured leaves every variant eager (logged)."""
        if self.greedy.try_capture():
            self._capture_sampling()

    def _capture_sampling(self) -> None:
        pool = self.greedy.pool
        for mode, steps in self.variants.items():
            if mode is not SamplingMode.GREEDY and steps.try_capture(pool):
                pool = steps.pool

    def run(self, size: int, mode: SamplingMode) -> Any:
        """Replay (or run eagerly) one variant of bucket `size`."""
        return self.variants[mode].run(size)


def time_call(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Mean seconds of `repeats` calls on `device` (CUDA events there, else wall time)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - t0) / repeats
