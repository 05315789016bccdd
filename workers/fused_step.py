"""Greedy speculative step as one fixed-shape function: target verify, draft re-run, K-step chain.

For a batch of generation requests that all decode greedily with K drafts, everything stays on the
device: the draft re-runs over all K+1 rows (row i reads the target's argmax at i, which equals the
accepted token i+1 up to the first mismatch and the bonus token there; rows past it write draft KV
that the chain overwrites before anything reads it), then the chain proposes K tokens from each
request's last accepted row. One CUDA graph per batch bucket; one host copy of the results per step.
"""

from __future__ import annotations

import torch

from proto.messages import DraftOutputs, SeqResult, StepPlan, TargetOutput
from speculative.mtp_chain import MTPEagleChain
from workers.attention import UniformMetadata
from workers.graph_runner import CapturedSteps, capture_sizes, pick_bucket
from workers.kv_cache import KVCache
from workers.model import LlamaModel
from workers.step_buffers import StepBuffers


class FusedGreedyStep:
    """Target + colocated MTP chain for uniform greedy generation steps (TP=1, draft in process)."""

    def __init__(
        self,
        target: LlamaModel,
        cache: KVCache,
        chain: MTPEagleChain,
        k: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device | str,
        use_graphs: bool = True,
    ) -> None:
        if k < 1:
            raise ValueError("the fused step needs at least one draft token")
        self.target, self.cache, self.chain, self.k = target, cache, chain, k
        dev = torch.device(device)
        sizes = capture_sizes(max_batch)
        self.buffers = StepBuffers.allocate(max_batch, k + 1, max_blocks, cache.block_size, cache.scratch_block, dev)
        self.buffers.fill([], [], [], max_batch)  # capture warm-up writes only the scratch block
        self.steps = CapturedSteps(self._forward, sizes, dev, use_graphs)

    @torch.no_grad()
    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, q, k = self.buffers, self.k + 1, self.k
        n = bucket * q
        tables = b.block_tables[:bucket]
        meta = UniformMetadata(b.slot_mapping[:n], tables, b.seq_lens[:bucket], q)
        ids, pos = b.input_ids[:n], b.positions[:n]
        hidden = self.target(ids, pos, self.cache, meta)
        argmax = self.target.logits(hidden).argmax(-1).view(bucket, q)  # [B, K+1]
        match = (ids.view(bucket, q)[:, 1:] == argmax[:, :-1]).to(torch.int64)
        n_acc = torch.cumprod(match, dim=1).sum(dim=1)  # [B]
        head, shared, dcache = self.chain.head, self.chain.shared, self.chain.cache
        dh = head(shared.embed(argmax.reshape(-1)), hidden, pos, dcache, meta)
        last = torch.arange(bucket, device=ids.device) * q + n_acc
        h = dh[last]
        tok = shared.logits(h).argmax(-1)
        p = pos[last]
        drafts = [tok]
        bs = self.cache.block_size
        for _ in range(k - 1):
            p = p + 1
            slots = tables.gather(1, (p // bs)[:, None]).squeeze(1) * bs + p % bs
            h = head(shared.embed(tok), h, p, dcache, UniformMetadata(slots, tables, p + 1, 1))
            tok = shared.logits(h).argmax(-1)
            drafts.append(tok)
        return argmax, n_acc, torch.stack(drafts, dim=1)

    def bucket_for(self, plan: StepPlan) -> int | None:
        """A bucket when every request is greedy generation with exactly K drafts and fits; else None."""
        q = self.k + 1
        for s in plan.seqs:
            if s.is_context or s.temperature > 0 or len(s.token_ids) != q:
                return None
            if len(s.block_ids) > self.buffers.max_blocks:
                return None
        return pick_bucket(len(plan.seqs), self.steps.sizes) if plan.seqs else None

    def run(self, plan: StepPlan, bucket: int) -> TargetOutput:
        """Fill the buffers, replay, and read back tokens, accept counts and next drafts in one copy."""
        seqs = plan.seqs
        self.buffers.fill([s.token_ids for s in seqs], [s.start for s in seqs], [s.block_ids for s in seqs], bucket)
        argmax, n_acc, drafts = self.steps.run(bucket)
        m = len(seqs)
        host = torch.cat([argmax[:m], n_acc[:m, None], drafts[:m]], dim=1).cpu()
        results = []
        for i, s in enumerate(seqs):
            a = int(host[i, self.k + 1])
            results.append(SeqResult(s.request_id, host[i, : a + 1].tolist(), self.k, a))
        proposals = DraftOutputs(plan.step_id, [s.request_id for s in seqs], host[:, self.k + 2 :].clone())
        return TargetOutput(plan.step_id, results, None, proposals)
