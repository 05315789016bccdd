"""Speculative step as one fixed-shape function: target verify, draft re-run, K-step chain.

For a batch of generation requests with K drafts, everything stays on the device: the target verifies
(greedy, or over its draws with the requests' temperature/top-k/top-p and sampling keys read from
fixed buffers), the draft re-runs over all K+1 rows (row i reads emitted token i: the accepted draft
i+1 up to the first rejection and the correction or bonus token there; rows past it write draft KV
that the chain overwrites before anything reads it), then the chain proposes K greedy tokens from each
request's last accepted row. Three CUDA graphs per batch bucket, one per sampling mode (all-greedy,
temperature only, top-k/top-p), in one memory pool; one host copy of the results per step. With K = 0 (the
depth-0 step of adaptive speculation) the target emits one token and the draft only writes its KV.

A step can also take its inputs from the previous step's results on the device (`launch(..., after=...)`):
each request's next tokens are its last emitted token and its new drafts, and its next position follows
its accepted count, so the host can queue the step before it has read the previous one.
"""

from __future__ import annotations

from functools import partial

import torch

from mtpserve.modeling import fused_kernels
from mtpserve.modeling.attention import UniformMetadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.messages import DraftOutputs, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.mtp_chain import MTPEagleChain, propose_from_rows
from mtpserve.speculative.sampling import SamplingMode
from mtpserve.speculative.verify import ForcedAcceptance, verify_step
from mtpserve.workers import step_kernels
from mtpserve.workers.graph_runner import GreedyAndSampledSteps, capture_sizes, time_call, uniform_bucket
from mtpserve.workers.step_buffers import ForcedRows, StepBuffers
from mtpserve.workers.uniform_step import fill_step


class FusedSpecStep:
    """Target + colocated MTP chain for uniform generation steps (TP=1, draft in process). With `replay`
    (benchmarks), greedy steps accept the counts it forces (`speculative/replay.py`)."""

    def __init__(
        self,
        target: LlamaModel,
        cache: KVCache,
        chain: MTPEagleChain,
        k: int,
        *,
        max_batch: int,
        max_blocks: int,
        device: torch.device | str,
        use_graphs: bool = True,
        replay: ForcedAcceptance | None = None,
    ) -> None:
        if k < 0:
            raise ValueError("the fused step's draft depth must be >= 0")
        self.target, self.cache, self.chain, self.k = target, cache, chain, k
        dev = torch.device(device)
        sizes = capture_sizes(max_batch)
        self.buffers = StepBuffers.allocate(
            max_batch, k + 1, max_blocks, cache.block_size, scratch_block=cache.scratch_block, device=dev
        )
        self.forced = None if replay is None else ForcedRows(replay, max_batch, k + 1, dev)  # depth 0: moves it on
        self.buffers.fill([], [], [], max_batch)  # capture warm-up writes only the scratch block
        self.steps = GreedyAndSampledSteps(self._forward, sizes, dev, use_graphs)
        self._row_offsets = torch.arange(k + 1, device=dev)  # a request's Q rows, for `_advance`

    @torch.no_grad()
    def _forward(self, bucket: int, mode: SamplingMode) -> torch.Tensor:
        b, q, k = self.buffers, self.k + 1, self.k
        n = bucket * q
        tables = b.block_tables[:bucket]
        meta = UniformMetadata(b.slot_mapping[:n], tables, b.seq_lens[:bucket], q)
        ids, pos = b.input_ids[:n], b.positions[:n]
        hidden, features = self.target.forward_features(ids, pos, self.cache, meta)
        sampling = None if mode is SamplingMode.GREEDY else b.sampling(bucket)
        forced = None if self.forced is None else self.forced.rows(bucket)
        n_acc, emitted = verify_step(
            self.target, hidden, ids, q, sampling=sampling, filtered=mode is SamplingMode.FILTERED, forced=forced
        )
        c = self.chain
        drafts = propose_from_rows(
            c.head,
            c.shared,
            c.cache,
            emitted.reshape(-1),
            hidden=features,
            positions=pos,
            meta=meta,
            num_accepted=n_acc,
            k=k,
        )
        next_start = pos.view(bucket, q)[:, 0] + n_acc + 1
        columns = [emitted, n_acc[:, None], drafts, next_start[:, None]]
        return torch.cat([t.to(emitted.dtype) for t in columns], dim=1)

    @property
    def replays(self) -> int:
        """CUDA-graph replays so far."""
        return self.steps.replays

    def depth_steps(self) -> dict[int, FusedSpecStep]:
        """This step by its depth (the one-depth view of FusedDepthSteps)."""
        return {self.k: self}

    def bucket_for(self, plan: StepPlan) -> int | None:
        """A bucket when every request is generation with exactly K one-hot drafts and fits; else None."""
        if plan.num_draft_tokens != self.k:
            return None
        return uniform_bucket(plan, self.k + 1, self.buffers.max_blocks, self.steps.sizes)

    def launch(
        self, plan: StepPlan, bucket: int, keys: list[int] | None = None, after: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fill the buffers and replay without waiting; returns the device results [m, 2K+3] of the real
        rows, per row [emitted K+1 | accepted | drafts K | next start] (valid until the next run).
        `keys` holds the requests' sampling keys; None for an all-greedy step. With
        `after` (a previous launch's results), each sequence's token_ids[0] is its row there, and its
        tokens and positions are taken from that row on the device."""
        mode = fill_step(self.buffers, plan, bucket, keys, forced=self.forced)
        m = len(plan.seqs)
        if after is not None:
            self._advance(m, after)
        return self.steps.run(bucket, mode)[:m]

    def warm_up(self) -> None:
        """Compile the input-advancing kernel before serving (its first call would otherwise stall the
        first launched step of this depth); leaves the buffers padded."""
        b = self.buffers
        b.fill([], [], [], b.max_batch)
        previous = torch.zeros(b.max_batch, 2 * self.k + 3, dtype=torch.long, device=b.input_ids.device)
        self._advance(b.max_batch, previous)
        b.fill([], [], [], b.max_batch)

    def _advance(self, m: int, previous: torch.Tensor) -> None:
        if previous.is_cuda and fused_kernels.available():
            step_kernels.advance_inputs(previous, self.buffers, m)
        else:
            step_kernels.advance_reference(previous, self.buffers, m, self._row_offsets)

    def read(self, plan: StepPlan, host: torch.Tensor) -> TargetOutput:
        """Tokens, accept counts and next drafts from a launch's results, copied to the host."""
        k = self.k
        rows = host.tolist()
        results = [
            SeqResult(s.request_id, row[: row[k + 1] + 1], k, row[k + 1])
            for s, row in zip(plan.seqs, rows, strict=True)
        ]
        drafts = host[:, k + 2 : 2 * k + 2].clone()  # `host` may be a buffer that a later launch reuses
        proposals = DraftOutputs(plan.step_id, [s.request_id for s in plan.seqs], drafts)
        return TargetOutput(plan.step_id, results, None, proposals)

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """Launch, then read back tokens, accept counts and next drafts in one copy."""
        return self.read(plan, self.launch(plan, bucket, keys).cpu())


class FusedDepthSteps:
    """Fused steps for every draft depth 0..K of adaptive speculation; a plan runs the step of its depth
    (`StepPlan.num_draft_tokens`). The steps share their CUDA-graph memory pool."""

    def __init__(self, steps: dict[int, FusedSpecStep]) -> None:
        if sorted(steps) != list(range(max(steps) + 1)) or any(s.k != k for k, s in steps.items()):
            raise ValueError("FusedDepthSteps needs one fused step per depth 0..K, keyed by its depth")
        self.by_depth = steps
        self.k = max(steps)
        self.buffers = steps[self.k].buffers  # the widest; every depth has the same max_batch

    @property
    def replays(self) -> int:
        """CUDA-graph replays so far, every depth."""
        return sum(s.replays for s in self.by_depth.values())

    def depth_steps(self) -> dict[int, FusedSpecStep]:
        """The step of each depth."""
        return self.by_depth

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket of the plan's depth step (see FusedSpecStep.bucket_for); None for another depth."""
        step = self.by_depth.get(plan.num_draft_tokens)
        return None if step is None else step.bucket_for(plan)

    def launch(
        self, plan: StepPlan, bucket: int, keys: list[int] | None = None, after: torch.Tensor | None = None
    ) -> torch.Tensor:
        """FusedSpecStep.launch on the plan's depth (`after` must come from a step of the same depth)."""
        return self.by_depth[plan.num_draft_tokens].launch(plan, bucket, keys, after)

    def read(self, plan: StepPlan, host: torch.Tensor) -> TargetOutput:
        """FusedSpecStep.read on the plan's depth."""
        return self.by_depth[plan.num_draft_tokens].read(plan, host)

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """FusedSpecStep.run on the plan's depth."""
        return self.by_depth[plan.num_draft_tokens].run(plan, bucket, keys)

    def time_steps(self, repeats: int = 10) -> dict[tuple[int, int], float]:
        """Seconds per greedy step by (batch bucket, depth), each the mean of `repeats` runs over the padded
        buffers (which write only the scratch block): the step costs of the adaptive policy."""
        out: dict[tuple[int, int], float] = {}
        for depth, step in self.by_depth.items():
            step.buffers.fill([], [], [], step.buffers.max_batch)
            for bucket in step.steps.sizes:
                run = partial(step.steps.run, bucket, SamplingMode.GREEDY)
                run()  # warm-up
                out[(bucket, depth)] = time_call(run, repeats, step.buffers.input_ids.device)
        return out
