"""MTP Eagle linear chain: one MTP layer reused K times over its own paged KV cache."""

from __future__ import annotations

import torch

from proto.messages import DraftInputs, DraftOutputs
from speculative.draft_inputs import draft_input_tokens, last_rows
from speculative.lookahead import LookaheadBuffer
from speculative.methods import DraftMethod
from speculative.mtp_head import MTPEagleHead
from workers.attention import ragged_metadata
from workers.kv_cache import KVCache
from workers.model import LlamaModel


class MTPEagleChain(DraftMethod):
    """Runs the draft head over accepted/context rows, then chains K greedy proposals.

    `shared` supplies the target's embedding, final norm and lm_head (a LlamaModel, possibly with no
    layers). Drafts are the head's argmax, so their distribution is one-hot and no draft probabilities
    need to travel to the verifier.
    """

    def __init__(
        self,
        head: MTPEagleHead,
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
        dtype = head.eh_proj.weight.dtype
        # Fixed-address step inputs: incoming rows are copied in, never reallocated.
        self.token_buf = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.position_buf = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.hidden_buf = torch.zeros(max_rows, head.args.hidden_size, dtype=dtype, device=self.device)

    @torch.no_grad()
    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Write draft KV for this step's rows and propose `num_draft_tokens` per proposing request."""
        dev = self.device
        k = inputs.num_draft_tokens
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
            inputs.sampled_tokens.to(dev),
            inputs.lookahead_source,
        )
        host_pos = inputs.positions
        starts = [int(host_pos[int(e) - int(n) + 1]) for e, n in zip(last_rows(seq_lens), seq_lens, strict=True)]
        meta = ragged_metadata(starts, inputs.seq_lens, inputs.block_ids, self.cache.block_size, dev)
        out = self.head(self.shared.embed(ids), hidden, positions, self.cache, meta)

        rows = [i for i, p in enumerate(inputs.propose) if p]
        if not rows or k == 0:
            return DraftOutputs(inputs.step_id, [], torch.zeros(0, k, dtype=torch.long))
        ends = last_rows(seq_lens)[rows].to(dev)
        h = out[ends]
        pos = positions[ends]
        tables = [inputs.block_ids[i] for i in rows]
        tok = self.shared.logits(h).argmax(-1)
        drafts = [tok]
        for _ in range(k - 1):
            pos = pos + 1
            meta = ragged_metadata(pos.tolist(), [1] * len(rows), tables, self.cache.block_size, dev)
            h = self.head(self.shared.embed(tok), h, pos, self.cache, meta)
            tok = self.shared.logits(h).argmax(-1)
            drafts.append(tok)
        return DraftOutputs(inputs.step_id, [inputs.request_ids[i] for i in rows], torch.stack(drafts, 1).cpu())
