"""MTP Eagle draft trees: one MTP layer grows a tree of candidates per request, EAGLE-2 style.

After the draft KV update over the step's rows (the chain's `rerun`, so the prompt lookahead and chunk
invariance are the chain's), each proposing request grows a tree from its last row (the root):

- depth 1: the `width` most likely tokens after the root;
- each later round runs the head once over the `width` frontier nodes of the deepest level (one row per
  node, reading its token and its parent's output), and scores every node's `width` most likely children by
  cumulative draft log-probability; the new frontier is the `width` best of those children;
- after `depth` levels the `budget` best nodes by cumulative log-probability are kept, in creation order
  (parents before children). A child never scores above its parent, and ties keep the earlier node, so a
  kept node's ancestors are kept too.

A frontier node of round r is written to draft KV slot root + 1 + (r - 1) * width + j, past the request's
accepted rows; it attends to the request's draft KV up to the root and to its own ancestors' rows
(`AttentionMetadata` row masks). Those rows are scratch: the next step's draft KV update rewrites the
positions the target accepts, and nothing reads the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtpserve.modeling.attention import Metadata, ragged_metadata
from mtpserve.speculative.draft_inputs import last_rows
from mtpserve.speculative.messages import DraftInputs, DraftOutputs
from mtpserve.speculative.methods import DraftMethod
from mtpserve.speculative.mtp_chain import MTPEagleChain


def tree_candidates(width: int, depth: int) -> int:
    """Nodes a tree of `depth` levels grows before pruning to its budget."""
    return width + (depth - 1) * width * width


def tree_scratch_slots(width: int, depth: int) -> int:
    """Draft KV slots past the root that a tree's frontier rows write."""
    return (depth - 1) * width


MetaFor = Callable[[int, torch.Tensor], Metadata]  # (round r, visibility [B, w, r*w]) -> the round's metadata


class MTPEagleTree(DraftMethod):
    """Draft trees of `budget` nodes (`depth` levels, `width` children per expanded node) from the MTP Eagle
    head of `chain`; proposals carry each node's parent (`DraftOutputs.draft_parents`). With `chains`
    (adaptive speculation), a step asking for another number of drafts than the budget gets `chain`'s
    proposals of that depth instead."""

    def __init__(self, chain: MTPEagleChain, depth: int, width: int, budget: int, chains: bool = False) -> None:
        width = min(width, chain.head.draft_vocab_size)
        if depth < 1 or width < 1 or not 1 <= budget <= tree_candidates(width, depth):
            raise ValueError(
                f"tree of depth {depth}, width {width} grows {tree_candidates(width, depth)} nodes; "
                f"budget {budget} must lie in [1, that]"
            )
        self.chain = chain
        self.depth = depth
        self.width = width
        self.budget = budget
        self.chains = chains

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (the chain keeps none)."""
        self.chain.release(request_ids)

    @torch.no_grad()
    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Write draft KV for this step's rows, then grow a tree for every proposing request (or, with
        `chains`, propose the chain's drafts when the step asks for fewer than the budget)."""
        if self.chains and inputs.num_draft_tokens != self.budget:
            return self.chain.propose(inputs)
        out, _ = self.chain.rerun(inputs)
        rows = [i for i, p in enumerate(inputs.propose) if p]
        if not rows or inputs.num_draft_tokens == 0:
            empty = torch.zeros(0, self.budget, dtype=torch.long)
            return DraftOutputs(inputs.step_id, [], empty, draft_parents=empty.clone())
        ends = last_rows(torch.tensor(inputs.seq_lens, dtype=torch.long))[rows]
        roots = inputs.positions[ends].tolist()
        tokens, parents, _ = self.grow_eager(out[ends.to(out.device)], roots, [inputs.block_ids[i] for i in rows])
        return DraftOutputs(
            inputs.step_id, [inputs.request_ids[i] for i in rows], tokens.cpu(), draft_parents=parents.cpu()
        )

    def grow_eager(
        self, h0: torch.Tensor, roots: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`grow` for B requests whose root rows sit at host positions `roots`, with per-step metadata."""
        w, dev, block_size = self.width, h0.device, self.chain.cache.block_size

        def meta_for(r: int, visible: torch.Tensor) -> Metadata:
            first = [p + 1 + (r - 1) * w for p in roots]
            masks: list[torch.Tensor | None] = list(visible.cpu())
            return ragged_metadata(first, [w] * len(roots), tables, block_size, device=dev, row_masks=masks)

        return self.grow(h0, torch.tensor(roots, device=dev), meta_for)

    def grow(
        self, h0: torch.Tensor, roots: torch.Tensor, meta_for: MetaFor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Trees for B requests whose root rows (at positions `roots` [B]) produced head outputs h0 [B, d], in
        fixed shapes (safe to capture); `meta_for` gives each round's attention metadata. Returns draft tokens
        [B, budget], their parents [B, budget] (0 = the root, j = draft j) and cumulative draft
        log-probabilities [B, budget], on the device."""
        head, shared, cache, w = self.chain.head, self.chain.shared, self.chain.cache, self.width
        bsz, dev = h0.shape[0], h0.device
        score, index = head.top_logprobs(shared, h0, w)  # [B, w]
        node_tokens = [head.token_ids(index)]
        node_parents = [torch.zeros(bsz, w, dtype=torch.long, device=dev)]
        node_scores = [score]
        frontier_ids = torch.arange(1, w + 1, device=dev).expand(bsz, w)  # node ids of the deepest level
        frontier_tok, frontier_h = node_tokens[0], h0[:, None, :].expand(bsz, w, h0.shape[-1])
        frontier_score = score
        span = tree_scratch_slots(w, self.depth)
        eye = torch.eye(w, dtype=torch.bool, device=dev)
        visible = torch.zeros(bsz, w, span, dtype=torch.bool, device=dev)  # frontier rows' ancestor slots
        next_id = w + 1
        for r in range(1, self.depth):
            visible[:, :, (r - 1) * w : r * w] |= eye
            meta = meta_for(r, visible[:, :, : r * w])
            pos = roots.repeat_interleave(w) + r
            h = head.step(
                shared,
                frontier_tok.reshape(-1),
                hidden=frontier_h.reshape(bsz * w, -1),
                positions=pos,
                cache=cache,
                meta=meta,
            )
            lp, idx = head.top_logprobs(shared, h, w)  # [B*w, w]
            child_score = (frontier_score[:, :, None] + lp.view(bsz, w, w)).reshape(bsz, w * w)
            node_tokens.append(head.token_ids(idx).view(bsz, w * w))
            node_parents.append(frontier_ids.repeat_interleave(w, dim=1))
            node_scores.append(child_score)
            frontier_score, pick = child_score.topk(w, dim=-1)
            parent = torch.div(pick, w, rounding_mode="floor")  # the frontier row each new node continues
            frontier_ids = next_id + pick
            frontier_tok = node_tokens[-1].gather(1, pick)
            frontier_h = h.view(bsz, w, -1).gather(1, parent[:, :, None].expand(-1, -1, h.shape[-1]))
            visible = visible.gather(1, parent[:, :, None].expand(-1, -1, span))
            next_id += w * w
        return prune(torch.cat(node_tokens, 1), torch.cat(node_parents, 1), torch.cat(node_scores, 1), self.budget)


def prune(
    tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each tree's `budget` best nodes, in fixed shapes. tokens / parents / scores [B, M] describe nodes
    1..M in creation order (parents [B, M] in 0..M, 0 = the root); returns tokens, renumbered parents and
    scores [B, budget], the kept nodes in creation order. Ties keep the earlier node.

    Element-wise kernels only (a node's rank counts the nodes that beat it), no sort: a sort adds copies
    and scratch that a captured step has to replay as extra graph nodes."""
    bsz, m = scores.shape
    scores = scores.float()
    earlier = torch.ones(m, m, dtype=torch.bool, device=scores.device).tril(-1)  # [i, j]: j < i
    s_i, s_j = scores[:, :, None], scores[:, None, :]
    beaten_by = (s_j > s_i) | ((s_j == s_i) & earlier)
    kept = beaten_by.sum(dim=2) < budget  # [B, M]
    slot = kept.long().cumsum(dim=1) - 1  # a kept node's place among the kept, in creation order
    dest = torch.where(kept, slot, budget)  # dropped nodes go to one spare column
    renumber = torch.cat([torch.zeros_like(slot[:, :1]), torch.where(kept, slot + 1, 0)], dim=1)  # old id -> new

    def pack(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(bsz, budget + 1)
        return out.scatter(1, dest, values)[:, :budget]

    return pack(tokens), pack(renumber.gather(1, parents)), pack(scores)
