"""Vanilla MTP: one distinct module per draft position, as DeepSeek-V3 trains them.

Module j's row i reads (token i+j+1, module j-1's output at row i), module -1 being the target. So every
module consumes the same newly known tokens in a step (the draft-row tokens: shifted context, prompt
lookahead at chunk ends, accepted tokens), paired with rows j positions further back. A row is written to
module j's KV once, when its token is known, and each module keeps its output at its last written row
for the next module's next step. The chain then extends module j by j speculative rows (the drafts so
far); those rows are overwritten when their tokens become known, before any written row can read them.
Draft KV therefore never depends on chunking or on earlier drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_inputs import draft_input_tokens
from mtpserve.speculative.lookahead import LookaheadBuffer
from mtpserve.speculative.messages import DraftInputs, DraftOutputs
from mtpserve.speculative.methods import DraftMethod
from mtpserve.speculative.mtp_head import MTPEagleHead


@dataclass
class _Rows:
    """One module's rows of one request in a step: position of local row 0, count, first valid local row."""

    first_pos: int
    count: int
    start: int  # local rows before it would sit at negative positions


class VanillaMTPChain(DraftMethod):
    """K modules, each with its own paged KV cache; module j proposes draft j+1."""

    def __init__(
        self,
        heads: list[MTPEagleHead],
        shared: LlamaModel,
        caches: list[KVCache],
        lookahead: LookaheadBuffer,
        device: torch.device | str = "cpu",
    ) -> None:
        if not heads or len(heads) != len(caches):
            raise ValueError("vanilla MTP needs one cache per module and at least one module")
        self.heads = heads
        self.shared = shared
        self.caches = caches
        self.cache = caches[0]
        self.lookahead = lookahead
        self.device = torch.device(device)
        self.carry: dict[str, list[torch.Tensor | None]] = {}  # per request: module j's output at its last row
        for h in heads:
            h.bind(shared)

    def release(self, request_ids: list[str]) -> None:
        """Drop the carried outputs of finished requests."""
        for rid in request_ids:
            self.carry.pop(rid, None)

    def _run(
        self, j: int, tokens: torch.Tensor, hidden: torch.Tensor, rows: list[_Rows], tables: list[list[int]]
    ) -> torch.Tensor:
        """Module j over the valid rows of every request (flattened); returns its outputs [N, d]."""
        pos = torch.cat([torch.arange(r.first_pos + r.start, r.first_pos + r.count) for r in rows]).to(self.device)
        meta = ragged_metadata(
            [r.first_pos + r.start for r in rows],
            [r.count - r.start for r in rows],
            tables,
            self.caches[j].block_size,
            device=self.device,
        )
        return self.heads[j].step(self.shared, tokens, hidden=hidden, positions=pos, cache=self.caches[j], meta=meta)

    @torch.no_grad()
    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Write each module's newly known rows, then chain one draft per module for proposing requests."""
        self.release(inputs.finished_request_ids)
        dev, k = self.device, min(inputs.num_draft_tokens, len(self.heads))
        self.lookahead.write(inputs.lookahead_tokens)
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.long)
        ctx_index = torch.full((len(inputs.seq_lens),), -1, dtype=torch.long)
        ctx_pos = [i for i, c in enumerate(inputs.is_context) if c]
        ctx_index[ctx_pos] = torch.arange(len(ctx_pos))
        ids = draft_input_tokens(
            inputs.token_ids.to(dev),
            seq_lens.to(dev),
            ctx_index.to(dev),
            self.lookahead.tokens,
            sampled_tokens=inputs.sampled_tokens.to(dev),
            lookahead_source=inputs.lookahead_source,
        )
        firsts = [0, *torch.cumsum(seq_lens, 0).tolist()[:-1]]
        p0 = [int(inputs.positions[f]) for f in firsts]
        n = inputs.seq_lens
        old = [self.carry.get(rid) for rid in inputs.request_ids]
        for b, start in enumerate(p0):
            if start > 0 and old[b] is None and len(self.heads) > 1:
                raise RuntimeError(
                    f"vanilla MTP has no carried state for request {inputs.request_ids[b]!r} at position {start}"
                )
        hidden = inputs.hidden_states.to(dev)
        outs: list[list[torch.Tensor]] = []  # outs[j][b]: module j's outputs at local rows 0..n_b-1 (invalid rows 0)
        for j in range(len(self.heads)):
            rows = [_Rows(p - j, c, max(0, j - p)) for p, c in zip(p0, n, strict=True)]
            live = [b for b, r in enumerate(rows) if r.count > r.start]
            full = [torch.zeros(c, self.heads[j].args.hidden_size, device=dev, dtype=self._dtype) for c in n]
            if live:
                if j == 0:
                    h_in, tok = hidden, ids
                else:
                    h_in = torch.cat([self._shifted(outs[j - 1][b], old[b], j - 1)[rows[b].start :] for b in live])
                    tok = torch.cat([ids[firsts[b] + rows[b].start : firsts[b] + n[b]] for b in live])
                out = self._run(j, tok, h_in, rows=[rows[b] for b in live], tables=[inputs.block_ids[b] for b in live])
                at = 0
                for b in live:
                    c = rows[b].count - rows[b].start
                    full[b][rows[b].start :] = out[at : at + c]
                    at += c
            outs.append(full)
        for b, rid in enumerate(inputs.request_ids):
            fresh = old[b] is None or p0[b] == 0  # a new request, or one recomputed after preemption
            carried: list[torch.Tensor | None] = [None] * len(self.heads) if fresh else list(old[b] or [])
            for j in range(len(self.heads)):
                if p0[b] + n[b] - 1 - j >= 0:
                    carried[j] = outs[j][b][-1].clone()  # not a view that keeps the step's rows
            self.carry[rid] = carried
        return self._chain(inputs, outs, [p + c - 1 for p, c in zip(p0, n, strict=True)], k)

    @property
    def _dtype(self) -> torch.dtype:
        return self.heads[0].eh_proj.weight.dtype

    @staticmethod
    def _shifted(prev: torch.Tensor, old: list[torch.Tensor | None] | None, j: int) -> torch.Tensor:
        """Module j's outputs one row back: its carried output, then this step's rows but the last."""
        carried = old[j] if old is not None else None
        first = carried if carried is not None else torch.zeros_like(prev[0])
        return torch.cat([first[None].to(prev.dtype), prev[:-1]])

    def _chain(self, inputs: DraftInputs, outs: list[list[torch.Tensor]], ends: list[int], k: int) -> DraftOutputs:
        """Draft 1 from module 0's last row; module j then runs its j speculative rows (drafts 1..j) on
        module j-1's last written and speculative outputs, and drafts token j+1."""
        props = [b for b, p in enumerate(inputs.propose) if p]
        if not props or k == 0:
            return DraftOutputs(inputs.step_id, [], torch.zeros(0, k, dtype=torch.long))
        last = {b: ends[b] for b in props}  # each request's last written position
        prev_last = torch.stack([outs[0][b][-1] for b in props])
        drafts = [self.heads[0].greedy_tokens(self.shared, prev_last)]
        spec: list[torch.Tensor] = [prev_last[:0].new_zeros(len(props), 0, prev_last.shape[-1])]  # module 0: none
        tables = [inputs.block_ids[b] for b in props]
        for j in range(1, k):
            rows = [_Rows(last[b] - j + 1, j, max(0, j - 1 - last[b])) for b in props]
            committed = torch.stack([outs[j - 1][b][-1] for b in props])[:, None]  # module j-1's last written row
            h_all = torch.cat([committed, spec[j - 1]], dim=1)  # [B, j, d]
            t_all = torch.stack(drafts, dim=1)  # [B, j]
            h_in = torch.cat([h_all[i, r.start :] for i, r in enumerate(rows)])
            t_in = torch.cat([t_all[i, r.start :] for i, r in enumerate(rows)])
            out = self._run(j, t_in, h_in, rows=rows, tables=tables)
            per, at = [], 0
            for r in rows:
                c = r.count - r.start
                per.append(torch.cat([out.new_zeros(r.start, out.shape[-1]), out[at : at + c]]))
                at += c
            spec.append(torch.stack(per))
            drafts.append(self.heads[j].greedy_tokens(self.shared, spec[j][:, -1]))
        return DraftOutputs(inputs.step_id, [inputs.request_ids[b] for b in props], torch.stack(drafts, 1).cpu())
