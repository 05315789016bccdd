"""The captured target-only generation step (forward + verify over fixed buffers) and the packing of
verify results that every uniform step shares."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mtpserve.modeling.attention import UniformMetadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.messages import SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.sampling import SamplingMode, sampling_mode
from mtpserve.speculative.verify import ForcedAcceptance, verify_step
from mtpserve.workers.graph_runner import GreedyAndSampledSteps, capture_sizes, uniform_bucket
from mtpserve.workers.step_buffers import ForcedRows, StepBuffers


class UniformTargetStep:
    """The target forward and verify of a generation step (B sequences x Q rows) over fixed buffers,
    captured per batch bucket on CUDA, once for all-greedy steps and once for steps that sample (their
    temperature, top-k, top-p and sampling keys are fixed buffers too). Returns the draft's features (the
    hidden states, or the concatenated outputs of the model's `feature_layers`), accept counts and emitted
    tokens. With `replay` (benchmarks), greedy verify steps accept what it forces (`speculative/replay.py`)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        q_len: int,
        *,
        max_batch: int,
        max_blocks: int,
        device: torch.device | str,
        use_graphs: bool = True,
        replay: ForcedAcceptance | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.q_len = q_len
        dev = torch.device(device)
        sizes = capture_sizes(max_batch)
        self.buffers = StepBuffers.allocate(
            max_batch, q_len, max_blocks, cache.block_size, scratch_block=cache.scratch_block, device=dev
        )
        self.forced = None if replay is None or q_len == 1 else ForcedRows(replay, max_batch, q_len, dev)
        self.buffers.fill([], [], [], max_batch)  # capture warm-up writes only the scratch block
        self.steps = GreedyAndSampledSteps(self._forward, sizes, dev, use_graphs)

    @torch.no_grad()
    def _forward(self, bucket: int, mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = self.buffers, bucket * self.q_len
        meta = UniformMetadata(b.slot_mapping[:n], b.block_tables[:bucket], b.seq_lens[:bucket], self.q_len)
        hidden, features = self.model.forward_features(b.input_ids[:n], b.positions[:n], self.cache, meta)
        sampling = None if mode is SamplingMode.GREEDY else b.sampling(bucket)
        filtered = mode is SamplingMode.FILTERED
        forced = None if self.forced is None else self.forced.rows(bucket)
        n_acc, tokens = verify_step(
            self.model, hidden, b.input_ids[:n], self.q_len, sampling=sampling, filtered=filtered, forced=forced
        )
        return features, pack_verified(n_acc, tokens)

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The batch bucket when every request is a generation row with Q tokens and fits; else None."""
        return uniform_bucket(plan, self.q_len, self.buffers.max_blocks, self.steps.sizes)

    def run(
        self,
        plan: StepPlan,
        bucket: int,
        keys: list[int] | None,
        tokens_from: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the buffers and replay; returns (features [m*Q, n*d], packed verify results [m, 1+Q], see
        `pack_verified`) of the real rows, valid until the next run. `keys` (each request's sampling key) is
        None for an all-greedy step. With `tokens_from` (a device tensor of the previous step's tokens, Q = 1), each
        sequence's token_ids hold a row of it instead of a token, and the token is gathered on the device."""
        seqs = plan.seqs
        mode = fill_step(self.buffers, plan, bucket, keys, forced=self.forced)
        if tokens_from is not None:
            ids = self.buffers.input_ids[: len(seqs)]
            ids.copy_(tokens_from.index_select(0, ids))
        hidden, packed = self.steps.run(bucket, mode)
        m = len(seqs)
        return hidden[: m * self.q_len], packed[:m]


def token_results(plan: StepPlan, rows: list[list[int]]) -> TargetOutput:
    """A target-only step's output from its packed verify rows (`pack_verified`), one token per request."""
    results = [SeqResult(s.request_id, [r[1]], 0, 0) for s, r in zip(plan.seqs, rows, strict=True)]
    return TargetOutput(plan.step_id, results)


def fill_step(
    buffers: StepBuffers,
    plan: StepPlan,
    bucket: int,
    keys: list[int] | None,
    forced: ForcedRows | None = None,
) -> SamplingMode:
    """Copy a uniform step's inputs (and, when it samples, its sampling parameters and keys; when it replays
    acceptance, its forced rows) into `buffers`; returns the captured variant the step runs (greedy when
    there are no keys)."""
    seqs = plan.seqs
    buffers.fill([s.token_ids for s in seqs], [s.start for s in seqs], [s.block_ids for s in seqs], bucket)
    if forced is not None:
        forced.fill(seqs, bucket)
    if keys is None:
        return SamplingMode.GREEDY
    buffers.fill_sampling(
        [s.temperature for s in seqs], [s.top_k for s in seqs], [s.top_p for s in seqs], keys=keys, bucket=bucket
    )
    return sampling_mode(seqs)


def pack_verified(n_acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Verify results (accepted [m], tokens [m, K+1]) as one tensor [m, 1 + K+1]: accepted, then tokens."""
    return torch.cat([n_acc[:, None].to(out.dtype), out], dim=1)


def read_verified(
    packed: torch.Tensor,
    members: Iterable[int],
    tokens: list[list[int]],
    accepted: list[int],
    last_token: list[int],
) -> None:
    """Copy packed verify results (`pack_verified`) to the host in one transfer and record each member
    request's emitted tokens, accept count and last token in the given lists."""
    host = packed.tolist()
    for row, i in zip(host, members, strict=True):
        accepted[i] = row[0]
        tokens[i] = row[1 : row[0] + 2]
        last_token[i] = tokens[i][-1]
