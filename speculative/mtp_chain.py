"""MTP Eagle linear chain: one MTP layer reused K times over its own paged KV cache."""

from __future__ import annotations

from typing import Any

import torch

from mtpserve.modeling.attention import UniformMetadata, ragged_metadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.draft_inputs import draft_input_tokens, last_rows
from mtpserve.speculative.lookahead import LookaheadBuffer
from mtpserve.speculative.messages import DraftInputs, DraftOutputs
from mtpserve.speculative.methods import DraftMethod


def propose_from_rows(
    head: DraftHead,
    shared: LlamaModel,
    cache: KVCache,
    row_tokens: torch.Tensor,
    hidden: torch.Tensor,
    *,
    positions: torch.Tensor,
    meta: UniformMetadata,
    num_accepted: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Draft re-run and K greedy proposals for a uniform step of B sequences x Q rows, in fixed shapes.

    Row i of a sequence reads (row_tokens[i], hidden[i]) at positions[i], where hidden holds the target's
    features for the head ([B*Q, n*d]); rows past a sequence's
    accepted ones write draft KV that the chain overwrites before anything reads it (or, with padded
    rows, the scratch block). The chain starts from row num_accepted[b]. Returns drafts [B, K]; with K = 0
    only the draft KV is written.
    """
    bsz, q = num_accepted.shape[0], meta.q_len
    dh = head.step(shared, row_tokens, hidden=hidden, positions=positions, cache=cache, meta=meta)
    if k == 0:
        return torch.zeros(bsz, 0, dtype=torch.long, device=row_tokens.device)
    last = torch.arange(bsz, device=row_tokens.device) * q + num_accepted
    return chain_from(
        head, shared, cache, dh[last], last_positions=positions[last], block_tables=meta.block_tables, k=k
    )


def chain_from(
    head: DraftHead,
    shared: LlamaModel,
    cache: KVCache,
    h: torch.Tensor,
    last_positions: torch.Tensor,
    block_tables: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """K greedy proposals [B, K] in fixed shapes from the head's outputs h [B, d] at each sequence's last
    row (positions [B]); draft k+1 reads draft k at the next position, whose KV it writes."""
    bsz = h.shape[0]
    tok = head.greedy_tokens(shared, h)
    drafts = [tok]
    if k > 1:
        pos, slots = chain_slots(last_positions, block_tables, cache.block_size, k - 1)
        cos, sin = head.rotary.table(pos.reshape(-1))
        seq_lens = pos + 1
        for j in range(k - 1):
            rows = slice(j * bsz, (j + 1) * bsz)
            step_meta = UniformMetadata(slots[j], block_tables, seq_lens[j], 1)
            h = head.step(
                shared, tok, hidden=h, positions=pos[j], cache=cache, meta=step_meta, rope=(cos[rows], sin[rows])
            )
            tok = head.greedy_tokens(shared, h)
            drafts.append(tok)
    return torch.stack(drafts, dim=1)


def chain_slots(
    start: torch.Tensor, block_tables: torch.Tensor, block_size: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and KV slots [steps, B] of the chain's next `steps` tokens after positions `start` [B],
    computed once for the whole chain (each row contiguous, for the step that reads it)."""
    pos = start[None, :] + torch.arange(1, steps + 1, device=start.device)[:, None]
    blocks = block_tables.gather(1, (pos // block_size).t()).t()
    return pos, (blocks * block_size + pos % block_size).contiguous()


class MTPEagleChain(DraftMethod):
    """Runs the draft head over accepted/context rows, then chains K greedy proposals.

    `head` is any draft head layout (MTP Eagle, EAGLE-3); `shared` supplies the target's embedding, final norm
    and lm_head (a LlamaModel, possibly with no layers). Drafts are the head's argmax, so their distribution is
    one-hot and no draft probabilities need to travel to the verifier.
    """

    def __init__(
        self,
        head: DraftHead,
        shared: LlamaModel,
        cache: KVCache,
        lookahead: LookaheadBuffer,
        device: torch.device | str = "cpu",
        max_rows: int = 512,
    ) -> None:
        self.head = head
        self.shared = shared
        self.cache = cache
        self.lookahead = lookahead
        self.device = torch.device(device)
        dtype = head.dtype
        # Fixed-address step inputs: incoming rows are copied in, never reallocated.
        self.token_buf = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.position_buf = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.hidden_buf = torch.zeros(max_rows, head.feature_size, dtype=dtype, device=self.device)
        head.bind(shared)
        self.uniform: Any = None  # a captured step for generation-only steps (UniformChainStep), on CUDA

    @torch.no_grad()
    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Write draft KV for this step's rows and propose `num_draft_tokens` per proposing request."""
        dev = self.device
        k = inputs.num_draft_tokens
        bucket = self.uniform.bucket_for(inputs) if self.uniform is not None else None
        if bucket is not None:
            self.lookahead.write(inputs.lookahead_tokens)
            return DraftOutputs(inputs.step_id, list(inputs.request_ids), self.uniform.run(inputs, bucket))
        out, positions = self.rerun(inputs)
        rows = [i for i, p in enumerate(inputs.propose) if p]
        if not rows or k == 0:
            return DraftOutputs(inputs.step_id, [], torch.zeros(0, k, dtype=torch.long))
        ends = last_rows(torch.tensor(inputs.seq_lens, dtype=torch.long))[rows].to(dev)
        h = out[ends]
        pos = positions[ends]
        tables = [inputs.block_ids[i] for i in rows]
        tok = self.head.greedy_tokens(self.shared, h)
        drafts = [tok]
        for _ in range(k - 1):
            pos = pos + 1
            meta = ragged_metadata(pos.tolist(), [1] * len(rows), tables, self.cache.block_size, device=dev)
            h = self.head.step(self.shared, tok, hidden=h, positions=pos, cache=self.cache, meta=meta)
            tok = self.head.greedy_tokens(self.shared, h)
            drafts.append(tok)
        return DraftOutputs(inputs.step_id, [inputs.request_ids[i] for i in rows], torch.stack(drafts, 1).cpu())

    def rerun(self, inputs: DraftInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write draft KV for this step's rows (eagerly); returns the head's outputs [T, d] and the rows'
        positions [T] on the device."""
        dev = self.device
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.long)
        ctx_index = torch.full((len(inputs.seq_lens),), -1, dtype=torch.long)
        ctx_pos = [i for i, c in enumerate(inputs.is_context) if c]
        ctx_index[ctx_pos] = torch.arange(len(ctx_pos))
        self.lookahead.write(inputs.lookahead_tokens)
        n_rows = inputs.token_ids.numel()
        if n_rows > self.token_buf.shape[0]:
            raise ValueError(f"{n_rows} draft rows exceed the fixed buffers ({self.token_buf.shape[0]} rows)")
        tokens = self.token_buf[:n_rows]
        tokens.copy_(inputs.token_ids, non_blocking=True)
        positions = self.position_buf[:n_rows]
        positions.copy_(inputs.positions, non_blocking=True)
        hidden = self.hidden_buf[:n_rows]
        hidden.copy_(inputs.hidden_states, non_blocking=True)
        ids = draft_input_tokens(
            tokens,
            seq_lens.to(dev),
            ctx_index.to(dev),
            self.lookahead.tokens,
            sampled_tokens=inputs.sampled_tokens.to(dev),
            lookahead_source=inputs.lookahead_source,
        )
        host_pos = inputs.positions
        starts = [int(host_pos[int(e) - int(n) + 1]) for e, n in zip(last_rows(seq_lens), seq_lens, strict=True)]
        meta = ragged_metadata(starts, inputs.seq_lens, inputs.block_ids, self.cache.block_size, device=dev)
        return self.head.step(
            self.shared, ids, hidden=hidden, positions=positions, cache=self.cache, meta=meta
        ), positions
