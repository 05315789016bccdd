"""The prompt chunks of a step as one fixed-shape step: target forward, first tokens, draft KV and drafts.

An eager prefill step costs 10-20 ms of host time on an H200 whatever its length (about 900 launches, each
with its own metadata), while its GPU work for a 512-token chunk is well under a millisecond. A replay of a
captured step is launch-bound too (about a millisecond for SmolLM2), so the chunks of one step go into one
replay: up to PREFILL_SLOTS chunks, back to back, padded to a bucket of T rows (powers of two up to the
step's token limit) and replayed from a CUDA graph captured per bucket.

- The target attends through the ragged Triton kernel, whose grid depends only on T and the slot count;
  lengths are read on the device, and unused slots have no rows. Padding rows run as rows past the last
  chunk: their KV goes to the scratch block, and that chunk's block table is padded with the scratch block
  far enough that they read only real or scratch keys, so every value stays finite. Real rows never see
  them (causal order).
- Each final chunk's first token is taken from its last real row on the device: greedy, or sampled with the
  request's temperature, top-k and top-p and its sampling key (the threshold of the token's position, as
  every step draws it), in fixed buffers; one graph per sampling mode, as for generation steps. Unused
  slots repeat the last chunk's row and settings, so whatever they write equals what it writes.
- With a colocated MTP chain the draft re-runs over the chunks in the same graph. Row i of a chunk reads
  token i+1; a chunk's last row reads its entry of the worker's fixed-address lookahead tensor (the next
  prompt token for a non-final chunk) and, where that is -1 (a final chunk), the first token. So the draft
  KV is what the eager path writes, and stays independent of the chunk size. Final chunks then chain K
  drafts; a non-final chunk's chain runs over the scratch block (it would write past the blocks the chunk
  holds) and its drafts are dropped. A step of non-final chunks only has its own graph without the chain.

Example, K=3, a step with chunk A (final, 5 rows, positions 0-4) and chunk B (non-final, 9 rows, positions
32-40, next prompt token 77), bucket 16: rows 0-4 are A's, rows 5-13 B's, rows 14-15 padding (B's q_len 11,
KV to the scratch block). Lookahead [-1, 77, -1, ...]; A's last row (4) reads A's first token, B's (13)
reads 77. Results: [[A's token, 3 drafts], [B's guess, 3 scratch drafts]]; B reports no token.

A step that mixes such chunks with generation rows runs as this step plus the captured generation step
(`TargetRunner.run_split`), read back together. Under adaptive speculation a step of the draft tree runs its
chunks here too, proposing the chain's K drafts. Steps with more chunks than PREFILL_SLOTS x
PREFILL_REPLAYS, draft trees (as the fixed mode), `sampled` lookahead and latent-attention models run eagerly
(`TargetRunner.execute`). Elsewhere than on CUDA the same function runs eagerly over the same buffers, so CPU
tests cover it.
"""

from __future__ import annotations

from functools import partial

import torch

from mtpserve.modeling.attention import RaggedMetadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_inputs import draft_input_tokens
from mtpserve.speculative.messages import DraftOutputs, SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.mtp_chain import MTPEagleChain, chain_from
from mtpserve.speculative.sampling import SamplingMode, processed_probs, sample_at_threshold, sampling_mode
from mtpserve.workers.graph_runner import CapturedSteps, GreedyAndSampledSteps, pick_bucket
from mtpserve.workers.prefill_buffers import PrefillBuffers

SMALLEST_BUCKET = 16  # the ragged kernel's query tile
PREFILL_REPLAYS = 4  # replays of the prefill step one step may take; more chunks run eagerly
PREFILL_ROWS = 2048  # rows a replay takes (the chunk size where that is larger), within the step's token budget


def prefill_sizes(max_tokens: int) -> list[int]:
    """Row buckets: powers of two from 16 below `max_tokens`, and `max_tokens` itself."""
    sizes, t = {max_tokens}, SMALLEST_BUCKET
    while t < max_tokens:
        sizes.add(t)
        t *= 2
    return sorted(sizes)


class CapturedPrefill:
    """The prompt chunks of a step, in fixed shapes: one CUDA graph per row bucket and sampling mode for
    steps with a final chunk, and with a draft chain one per bucket for steps of non-final chunks only
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
            max_tokens,
            max_blocks,
            block_size=cache.block_size,
            scratch_block=cache.scratch_block,
            device=dev,
            twins=PREFILL_REPLAYS + 1,
        )
        self._copied: list[torch.cuda.Event | None] = [None] * (PREFILL_REPLAYS + 1)  # when each twin's copy left
        self._lookahead = [chain.lookahead.staging() for _ in self._copied] if chain is not None else []
        sizes = prefill_sizes(max_tokens)
        self.final = GreedyAndSampledSteps(partial(self._forward, final=True), sizes, dev, use_graphs)
        self.partial = (
            CapturedSteps(partial(self._forward, mode=SamplingMode.GREEDY, final=False), sizes, dev, use_graphs)
            if chain
            else None
        )

    @property
    def sizes(self) -> list[int]:
        """The row buckets."""
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
            token = self.model.greedy_tokens(last_hidden)  # [S]
        else:
            t, k, p, u = b.sampling()
            probs = processed_probs(self.model.logits(last_hidden), t, k, p, filtered=mode is SamplingMode.FILTERED)
            token = sample_at_threshold(probs, u)
        c = self.chain
        if c is None:
            return token[:, None]
        rows = draft_input_tokens(ids, b.real_len, b.source, c.lookahead.tokens, sampled_tokens=token)
        out = c.head.step(c.shared, rows, hidden=features, positions=pos, cache=c.cache, meta=meta)
        if not final:
            return token[:, None]
        last = b.last_row
        h, last_pos = out.index_select(0, last), pos.index_select(0, last)
        drafts = chain_from(c.head, c.shared, c.cache, h, last_positions=last_pos, block_tables=b.chain_table, k=self.k)
        return torch.cat([token[:, None], drafts], dim=1)

    def bucket_for(self, plan: StepPlan) -> int | None:
        """A bucket when every request of the step is a prompt chunk and they fit one replay; else None. A step
        asking for more than K drafts (adaptive speculation's tree) gets the chain's K, which the next step
        fits into its tree."""
        groups = self.groups(plan.seqs)
        return groups[0][1] if groups is not None and len(groups) == 1 else None

    def groups(self, seqs: list[SeqPlan]) -> list[tuple[list[int], int]] | None:
        """The chunks split, in order, into replays that each fit, with each replay's row bucket (at most
        PREFILL_REPLAYS replays); None when they do not fit that many, or a chunk fits none (too many blocks,
        a draft tree)."""
        out: list[list[int]] = []
        rows: list[int] = []
        for i, s in enumerate(seqs):
            if not s.is_context or s.draft_parents is not None or not self.buffers.fits([s]):
                return None
            n = len(s.token_ids)
            if out and len(out[-1]) < self.buffers.slots and rows[-1] + n <= self.buffers.max_tokens:
                out[-1].append(i)
                rows[-1] += n
            else:
                out.append([i])
                rows.append(n)
        if not out or len(out) > PREFILL_REPLAYS:
            return None
        return [(group, self._bucket(n)) for group, n in zip(out, rows, strict=True)]

    def _bucket(self, rows: int) -> int:
        bucket = pick_bucket(rows, self.sizes)
        assert bucket is not None  # the largest bucket is max_tokens, which `fits` holds the rows to
        return bucket

    def launch(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> torch.Tensor:
        """Fill and replay without waiting: a device tensor [chunks, 1 + drafts] (first token or the argmax
        guess, then a final chunk's drafts) that stays valid until the next launch. `keys` holds each chunk's
        sampling key (0 where it is greedy or not final), or None when none samples."""
        seqs = plan.seqs
        twin = self.buffers.rotate()
        copied = self._copied[twin]
        if copied is not None:
            copied.synchronize()  # an earlier launch's copies read the host buffers refilled here
        self.buffers.fill(seqs, bucket)
        finals = [s for s in seqs if s.is_final_chunk]
        mode = sampling_mode(finals)
        if mode is not SamplingMode.GREEDY:
            if not keys:
                raise ValueError("a sampling final chunk needs its sampling key")
            self.buffers.fill_sampling(seqs, keys)
        if self.chain is not None:
            self.chain.lookahead.write([s.lookahead_token for s in seqs], host=self._lookahead[twin])
        if self.buffers.packed.is_cuda:
            event = self._copied[twin] = torch.cuda.Event()
            event.record()
        if self.partial is not None and not finals:
            return self.partial.run(bucket)[: len(seqs)]
        return self.final.run(bucket, mode)[: len(seqs)]

    def read(self, plan: StepPlan, rows: list[list[int]]) -> TargetOutput:
        """The step's results from `launch`'s rows: final chunks' first tokens and, with a chain, their
        drafts."""
        pairs = list(zip(plan.seqs, rows, strict=True))
        results = [SeqResult(s.request_id, row[:1] if s.is_final_chunk else [], 0, 0) for s, row in pairs]
        if self.chain is None:
            return TargetOutput(plan.step_id, results)
        final = [(s, row) for s, row in pairs if s.is_final_chunk]
        n = min(plan.num_draft_tokens, self.k)  # a shorter chain's drafts are the first of K (a tree: K)
        ids = torch.tensor([row[1 : 1 + n] for _, row in final], dtype=torch.long).view(len(final), n)
        drafts = DraftOutputs(plan.step_id, [s.request_id for s, _ in final], ids)
        return TargetOutput(plan.step_id, results, None, drafts)

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """`launch`, then read back."""
        return self.read(plan, self.launch(plan, bucket, keys).tolist())

    def capture(self) -> None:
        """Capture every bucket and variant (CUDA only) in one memory pool; a variant that cannot be
        captured runs eagerly over the same buffers (logged). The capture's warm-up runs read a one-token
        sampled chunk on the scratch block, not zeroed buffers: a chunk of no keys and temperature 0 gives
        NaN logits, and the steps that read their tokens would then index with them."""
        dummy = SeqPlan(
            "capture", [0], 0, [], is_context=True, is_final_chunk=True, lookahead_token=-1, temperature=1.0
        )
        self.buffers.fill([dummy], self.sizes[0])
        self.buffers.fill_sampling([dummy], [0])
        self.final.try_capture()
        if self.partial is not None:
            self.partial.try_capture(self.final.greedy.pool)
