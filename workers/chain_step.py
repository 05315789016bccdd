"""The MTP chain of a generation-only step over fixed buffers, captured per batch bucket on CUDA.

Used where the draft runs apart from the target's captured step (the separate draft worker, or rank 0
under tensor parallelism). Each request's accepted rows (accepted + 1 of the K + 1) are placed at the
start of its Q = K + 1 fixed rows; the remaining rows are padding that writes only the scratch block.
"""

from __future__ import annotations

import torch

from mtpserve.modeling.attention import UniformMetadata
from mtpserve.speculative.messages import DraftInputs
from mtpserve.speculative.mtp_chain import MTPEagleChain, propose_from_rows
from mtpserve.workers.graph_runner import CapturedSteps, capture_sizes, pick_bucket
from mtpserve.workers.step_buffers import StepBuffers


class UniformChainStep:
    """Draft re-run + K-step chain for B generation requests, one CUDA graph per batch bucket."""

    def __init__(
        self,
        chain: MTPEagleChain,
        k: int,
        max_batch: int,
        max_blocks: int,
        use_graphs: bool = True,
    ) -> None:
        if k < 1:
            raise ValueError("the chain step needs at least one draft token")
        self.chain, self.k, self.q = chain, k, k + 1
        dev, cache = chain.device, chain.cache
        rows = max_batch * self.q
        self.buffers = StepBuffers.allocate(
            max_batch, self.q, max_blocks, cache.block_size, scratch_block=cache.scratch_block, device=dev
        )
        self.buffers.fill([], [], [], max_batch)
        dtype = chain.head.dtype
        self.hidden = torch.zeros(rows, chain.head.feature_size, dtype=dtype, device=dev)
        self.num_accepted = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.steps = CapturedSteps(self._forward, capture_sizes(max_batch), dev, use_graphs)

    @torch.no_grad()
    def _forward(self, bucket: int) -> torch.Tensor:
        b, n = self.buffers, bucket * self.q
        meta = UniformMetadata(b.slot_mapping[:n], b.block_tables[:bucket], b.seq_lens[:bucket], self.q)
        c = self.chain
        return propose_from_rows(
            c.head, c.shared, c.cache, b.input_ids[:n], hidden=self.hidden[:n], positions=b.positions[:n], meta=meta,
            num_accepted=self.num_accepted[:bucket], k=self.k,
        )  # fmt: skip

    def bucket_for(self, inputs: DraftInputs) -> int | None:
        """A bucket when every request is a proposing generation request with K drafts and fits; else None."""
        if inputs.num_draft_tokens != self.k or not inputs.request_ids:
            return None
        if any(inputs.is_context) or not all(inputs.propose) or max(inputs.seq_lens) > self.q:
            return None
        if any(len(t) > self.buffers.max_blocks for t in inputs.block_ids):
            return None
        return pick_bucket(len(inputs.request_ids), self.steps.sizes)

    def run(self, inputs: DraftInputs, bucket: int) -> torch.Tensor:
        """Fill the buffers from `inputs`, replay, and return the drafts [m, K] on the host."""
        q, m = self.q, len(inputs.seq_lens)
        ids = inputs.token_ids.tolist()
        sampled = inputs.sampled_tokens.tolist()
        positions = inputs.positions.tolist()
        starts: list[int] = []
        rows: list[list[int]] = []
        dest: list[int] = []
        off = 0
        for i, n in enumerate(inputs.seq_lens):
            rows.append([*ids[off + 1 : off + n], sampled[i]] + [0] * (q - n))  # row j reads the token at j + 1
            starts.append(positions[off])
            dest.extend(range(i * q, i * q + n))
            off += n
        self.buffers.fill(rows, starts, inputs.block_ids, bucket, valid_rows=list(inputs.seq_lens))
        index = torch.tensor(dest, dtype=torch.long).to(self.hidden.device, non_blocking=True)
        self.hidden.index_copy_(0, index, inputs.hidden_states.to(self.hidden.device, self.hidden.dtype))
        acc = torch.tensor([n - 1 for n in inputs.seq_lens] + [0] * (bucket - m), dtype=torch.long)
        self.num_accepted[:bucket].copy_(acc, non_blocking=True)
        return self.steps.run(bucket)[:m].cpu()

    def capture(self) -> None:
        """Capture every bucket (CUDA only); on failure the same buffers run eagerly (logged)."""
        self.steps.try_capture()
