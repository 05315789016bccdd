"""A lone request's prompt chunk as one fixed-shape step: target forward, first token, draft KV and drafts.

An eager prefill step costs 10-20 ms of host time on an H200 whatever its length (about 900 launches, each
with its own metadata), while its GPU work for a 512-token chunk is well under a millisecond. When a step
holds exactly one request and that request is a prompt chunk (the time-to-first-token case), it runs here
instead: the chunk is padded to a bucket of T rows (powers of two up to the chunk size) and replayed from
a CUDA graph captured per bucket.

- The target attends through the ragged Triton kernel, whose grid depends only on T; lengths are read on
  the device. Padding rows run as rows past the chunk: their KV goes to the scratch block, and the block
  table is padded with the scratch block far enough that they read only real or scratch keys, so every
  value stays finite. Real rows never see them (causal order).
- The first token is taken from the last real row on the device: greedy, or sampled with the request's
  temperature, top-k and top-p and its sampling key (the threshold of the token's position, as every step
  draws it), in fixed buffers; one graph per sampling mode, as for generation steps.
- With a colocated MTP chain the draft re-runs over the chunk in the same graph. Row i reads token i+1;
  the last row reads the worker's fixed-address lookahead tensor (the next prompt token for a non-final
  chunk) and, where that is -1 (a final chunk), the first token. So the draft KV is what the eager path
  writes, and stays independent of the chunk size. A final chunk then chains K drafts; a non-final chunk
  has its own graph without the chain, which would write past the blocks a non-final chunk holds.

A step that mixes one such chunk with generation rows runs as this step plus the captured generation
step (`TargetRunner.run_split`). Under adaptive speculation a step of the draft tree runs its lone chunk here
too, proposing the chain's K drafts. Steps with several prompt chunks, draft trees (as the fixed mode),
`sampled` lookahead and latent-attention models run eagerly (`TargetRunner.execute`). Elsewhere than on
CUDA the same function runs eagerly over the same buffers, so CPU tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from mtpserve.modeling.attention import RaggedMetadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_inputs import draft_input_tokens
from mtpserve.speculative.messages import DraftOutputs, SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.mtp_chain import MTPEagleChain, chain_from
from mtpserve.speculative.sampling import (
    SamplingMode,
    keyed_thresholds,
    processed_probs,
    sample_at_threshold,
    sampling_mode,
)
from mtpserve.workers.graph_runner import CapturedSteps, GreedyAndSampledSteps, pick_bucket

SMALLEST_BUCKET = 16  # the ragged kernel's query tile


def prefill_sizes(max_tokens: int) -> list[int]:
    """Chunk-length buckets: powers of two from 16 below `max_tokens`, and `max_tokens` itself."""
    sizes, t = {max_tokens}, SMALLEST_BUCKET
    while t < max_tokens:
        sizes.add(t)
        t *= 2
    return sorted(sizes)


@dataclass
class PrefillBuffers:
    """Fixed-address inputs of one chunk, every field a view of one device tensor filled by one copy:
    [ids T | positions T | slots T | block table M | q start | rows | KV length | real rows | last row]."""

    packed: torch.Tensor
    staging: torch.Tensor  # its host twin (pinned on CUDA)
    input_ids: torch.Tensor  # [T_max]
    positions: torch.Tensor  # [T_max] (padding rows: 0)
    slot_mapping: torch.Tensor  # [T_max] (padding rows: the scratch block)
    block_table: torch.Tensor  # [1, M + T_max / block_size + 1] (past the request's blocks: the scratch block)
    q_start: torch.Tensor  # [1], always 0
    q_len: torch.Tensor  # [1] the bucket T: padding rows run too
    seq_len: torch.Tensor  # [1] start + T
    real_len: torch.Tensor  # [1] the chunk's rows n
    last_row: torch.Tensor  # [1] n - 1
    fpacked: torch.Tensor  # device float32 [temperature | top-k | top-p | key (int32 bits)] of a sampling final chunk
    fstaging: torch.Tensor  # its host twin
    block_size: int
    scratch_block: int
    max_blocks: int  # blocks a request may hold

    @classmethod
    def allocate(
        cls, max_tokens: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device
    ) -> PrefillBuffers:
        """Buffers for chunks of up to `max_tokens` rows and requests of up to `max_blocks` blocks."""
        width = max_blocks + -(-max_tokens // block_size) + 1
        sizes = [max_tokens, max_tokens, max_tokens, width, 1, 1, 1, 1, 1]
        packed = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        staging = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        ids, pos, slots, table, q_start, q_len, seq_len, real_len, last = packed.split(sizes)
        fpacked = torch.zeros(4, dtype=torch.float32, device=device)
        fstaging = torch.zeros(4, dtype=torch.float32, pin_memory=device.type == "cuda")
        return cls(
            packed=packed, staging=staging, input_ids=ids, positions=pos, slot_mapping=slots,
            block_table=table.view(1, width), q_start=q_start, q_len=q_len, seq_len=seq_len, real_len=real_len,
            last_row=last, fpacked=fpacked, fstaging=fstaging, block_size=block_size, scratch_block=scratch_block,
            max_blocks=max_blocks,
        )  # fmt: skip

    def sampling(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, threshold), one row each: the threshold of the position the chunk's last row
        predicts, from the request's key."""
        t, k, p, key = self.fpacked.split(1)
        return t, k, p, keyed_thresholds(key.view(torch.int32), self.positions.index_select(0, self.last_row) + 1)

    @property
    def max_tokens(self) -> int:
        """Rows a chunk may have."""
        return self.input_ids.shape[0]

    def fill(self, seq: SeqPlan, bucket: int) -> None:
        """Copy one chunk into rows [0, n) and pad rows [n, bucket)."""
        n, t_max, bs = len(seq.token_ids), self.max_tokens, self.block_size
        if not 0 < n <= bucket <= t_max or len(seq.block_ids) > self.max_blocks:
            raise ValueError(f"a chunk of {n} rows and {len(seq.block_ids)} blocks does not fit bucket {bucket}")
        host = self.staging.numpy()
        width = self.block_table.shape[1]
        ids, pos, slots = host[:t_max], host[t_max : 2 * t_max], host[2 * t_max : 3 * t_max]
        table = host[3 * t_max : 3 * t_max + width]
        table[:] = self.scratch_block
        table[: len(seq.block_ids)] = seq.block_ids
        rows = np.arange(bucket)
        real = rows[:n] + seq.start
        ids[:bucket] = 0
        ids[:n] = seq.token_ids
        pos[:bucket] = 0  # padding rows' RoPE angle; they attend by row, not by position
        pos[:n] = real
        slots[:bucket] = self.scratch_block * bs + rows % bs
        slots[:n] = table[real // bs] * bs + real % bs
        host[3 * t_max + width :] = [0, bucket, seq.start + bucket, n, n - 1]
        self.packed.copy_(self.staging, non_blocking=True)

    def fill_sampling(self, seq: SeqPlan, key: int) -> None:
        """Copy a sampling chunk's temperature, top-k, top-p and sampling key."""
        host = self.fstaging.numpy()
        host[:3] = (seq.temperature, seq.top_k, seq.top_p)
        host[3:].view(np.int32)[0] = key
        self.fpacked.copy_(self.fstaging, non_blocking=True)


class CapturedPrefill:
    """The prompt chunk of a step that holds one request, in fixed shapes: one CUDA graph per chunk-length
    bucket and sampling mode for final chunks, and with a draft chain one per bucket for non-final chunks
    (which sample nothing and chain no drafts)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        chain: MTPEagleChain | None,
        k: int,
        *,
        max_tokens: int,
        max_blocks: int,
        device: torch.device | str,
        use_graphs: bool = True,
    ) -> None:
        if chain is not None and k < 1:
            raise ValueError("a draft chain needs at least one draft token")
        self.model, self.cache, self.chain, self.k = model, cache, chain, k
        dev = torch.device(device)
        self.buffers = PrefillBuffers.allocate(
            max_tokens, max_blocks, block_size=cache.block_size, scratch_block=cache.scratch_block, device=dev
        )
        self._first_context = torch.zeros(1, dtype=torch.long, device=dev)  # the chunk is context request 0
        sizes = prefill_sizes(max_tokens)
        self.final = GreedyAndSampledSteps(partial(self._forward, final=True), sizes, dev, use_graphs)
        self.partial = (
            CapturedSteps(partial(self._forward, mode=SamplingMode.GREEDY, final=False), sizes, dev, use_graphs)
            if chain
            else None
        )

    @property
    def sizes(self) -> list[int]:
        """The chunk-length buckets."""
        return self.final.sizes

    @property
    def replays(self) -> int:
        """CUDA-graph replays so far, every variant."""
        return self.final.replays + (self.partial.replays if self.partial is not None else 0)

    @torch.no_grad()
    def _forward(self, bucket: int, mode: SamplingMode, final: bool) -> torch.Tensor:
        b = self.buffers
        meta = RaggedMetadata(
            b.slot_mapping[:bucket], b.block_table, b.q_start, b.q_len, seq_lens=b.seq_len, max_q_len=bucket
        )
        ids, pos = b.input_ids[:bucket], b.positions[:bucket]
        hidden, features = self.model.forward_features(ids, pos, self.cache, meta)
        last_hidden = hidden.index_select(0, b.last_row)
        if mode is SamplingMode.GREEDY:
            token = self.model.greedy_tokens(last_hidden)  # [1]
        else:
            t, k, p, u = b.sampling()
            probs = processed_probs(self.model.logits(last_hidden), t, k, p, filtered=mode is SamplingMode.FILTERED)
            token = sample_at_threshold(probs, u)
        c = self.chain
        if c is None:
            return token[:, None]
        rows = draft_input_tokens(ids, b.real_len, self._first_context, c.lookahead.tokens, sampled_tokens=token)
        out = c.head.step(c.shared, rows, hidden=features, positions=pos, cache=c.cache, meta=meta)
        if not final:
            return token[:, None]
        last = b.last_row
        drafts = chain_from(c.head, c.shared, c.cache, out.index_select(0, last),
                            last_positions=pos.index_select(0, last), block_tables=b.block_table, k=self.k)  # fmt: skip
        return torch.cat([token[:, None], drafts], dim=1)

    def bucket_for(self, plan: StepPlan) -> int | None:
        """A bucket when the step is one prompt chunk that fits; else None. A step asking for more than K
        drafts (adaptive speculation's tree) gets the chain's K, which the next step fits into its tree."""
        if len(plan.seqs) != 1:
            return None
        s = plan.seqs[0]
        if not s.is_context or s.draft_parents is not None:
            return None
        if len(s.block_ids) > self.buffers.max_blocks:
            return None
        return pick_bucket(len(s.token_ids), self.sizes)

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """Fill, replay and read the first token (final chunks) and, with a chain, the drafts. `keys` holds a
        sampling final chunk's sampling key."""
        s = plan.seqs[0]
        self.buffers.fill(s, bucket)
        mode = sampling_mode([s]) if s.is_final_chunk else SamplingMode.GREEDY
        if mode is not SamplingMode.GREEDY:
            if not keys:
                raise ValueError("a sampling final chunk needs its sampling key")
            self.buffers.fill_sampling(s, keys[0])
        if self.chain is not None:
            self.chain.lookahead.write([s.lookahead_token])
        if self.partial is not None and not s.is_final_chunk:
            row = self.partial.run(bucket)[0].tolist()
        else:
            row = self.final.run(bucket, mode)[0].tolist()
        result = SeqResult(s.request_id, row[:1] if s.is_final_chunk else [], 0, 0)
        drafts = None
        if self.chain is not None:
            proposing = s.is_final_chunk
            kept = row[1 : 1 + plan.num_draft_tokens]  # a shorter chain's drafts are the first of K (a tree: K)
            ids = torch.tensor([kept] if proposing else [], dtype=torch.long).view(int(proposing), len(kept))
            drafts = DraftOutputs(plan.step_id, [s.request_id] if proposing else [], ids)
        return TargetOutput(plan.step_id, [result], None, drafts)

    def capture(self) -> None:
        """Capture every bucket and variant (CUDA only) in one memory pool; a variant that cannot be
        captured runs eagerly over the same buffers (logged). The capture's warm-up runs read a one-token
        sampled chunk on the scratch block, not zeroed buffers: a chunk of no keys and temperature 0 gives
        NaN logits, and the steps that read their tokens would then index with them."""
        dummy = SeqPlan(
            "capture", [0], 0, [], is_context=True, is_final_chunk=True, lookahead_token=-1, temperature=1.0
        )
        self.buffers.fill(dummy, self.sizes[0])
        self.buffers.fill_sampling(dummy, 0)
        self.final.try_capture()
        if self.partial is not None:
            self.partial.try_capture(self.final.greedy.pool)
