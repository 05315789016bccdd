"""A greedy draft-tree step as one fixed-shape function: tree verify, branch KV moves, draft re-run, new trees.

For B generation requests each carrying a tree of N drafted nodes, everything stays on the device:

1. the target runs the N + 1 nodes of every tree (node i in the slot of position start + i, rotated for
   start + depth(i), attending to the prefix and its ancestors: `UniformMetadata.tree_mask`);
2. `greedy_walk` accepts along one branch; the accepted nodes' target KV moves to positions start + 1..;
3. the draft re-runs over rows start..start + D (row i reads emitted token i and the target features of
   the branch's i-th node; rows past the accepted ones write draft KV that nothing reads before it is
   rewritten);
4. `MTPEagleTree.grow` grows each request's next tree from its last accepted row.

Steps that sample walk each tree as a greedy one over the target's keyed draws (`tree_draws`, with the
requests' temperature/top-k/top-p and sampling keys in fixed buffers). One CUDA graph per batch bucket and
sampling mode, and one host copy of the results per step.

A step can also take its inputs from the previous tree step's results on the device (`launch(..., after=...)`,
`workers/tree_inputs.py`): each request's next tokens are its bonus token and its new tree, its tree's
parents, depths and ancestor mask come from that tree, and its next position follows its accepted count, so
the host can queue the step before it has read the previous one.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch.profiler import record_function

from mtpserve.modeling import fused_kernels
from mtpserve.modeling.attention import Metadata, UniformMetadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.messages import DraftOutputs, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.mtp_chain import chain_slots
from mtpserve.speculative.mtp_tree import MetaFor, MTPEagleTree
from mtpserve.speculative.sampling import SamplingMode, processed_probs, sampling_mode
from mtpserve.speculative.tree import forced_walk, greedy_walk, tree_draws
from mtpserve.speculative.verify import ForcedAcceptance
from mtpserve.workers import tree_kernels
from mtpserve.workers.graph_runner import GreedyAndSampledSteps, capture_sizes, time_call, uniform_bucket
from mtpserve.workers.step_buffers import ForcedRows, StepBuffers
from mtpserve.workers.tree_inputs import ResultColumns, TreeBuffers, advance_trees


def tree_kernels_apply(t: torch.Tensor) -> bool:
    """Whether steps over device tensors like t walk their trees (greedy) and advance launched trees in single
    Triton launches (`workers/tree_kernels.py`): on CUDA."""
    return t.is_cuda and fused_kernels.available()


class FusedTreeStep:
    """Target + colocated tree drafter for generation steps with trees of `drafter.budget` nodes (TP=1, draft
    in process). With `replay` (benchmarks), greedy steps accept the branches it forces
    (`speculative/replay.py`)."""

    def __init__(
        self,
        target: LlamaModel,
        cache: KVCache,
        drafter: MTPEagleTree,
        *,
        max_batch: int,
        max_blocks: int,
        device: torch.device | str,
        use_graphs: bool = True,
        replay: ForcedAcceptance | None = None,
    ) -> None:
        self.target, self.cache, self.drafter = target, cache, drafter
        self.q_len = drafter.budget + 1
        self.depth = min(drafter.depth, drafter.budget)  # the deepest a tree of this budget can be
        dev = torch.device(device)
        self.forced = None if replay is None else ForcedRows(replay, max_batch, self.q_len, dev)
        self.buffers = StepBuffers.allocate(
            max_batch, self.q_len, max_blocks, cache.block_size, scratch_block=cache.scratch_block, device=dev
        )
        self.buffers.fill([], [], [], max_batch)  # capture warm-up writes only the scratch block
        self.trees = TreeBuffers(max_batch, self.q_len, dev)
        self.columns = ResultColumns(self.depth, drafter.budget)  # the packed results' layout
        self.steps = GreedyAndSampledSteps(self._forward, capture_sizes(max_batch), dev, use_graphs)
        self.runs = 0  # steps run, captured or not

    @torch.no_grad()
    def _forward(self, bucket: int, mode: SamplingMode) -> torch.Tensor:
        b, t, q, d = self.buffers, self.trees, self.q_len, self.depth
        n = bucket * q
        tables, slots = b.block_tables[:bucket], b.slot_mapping[:n].view(bucket, q)
        ids = b.input_ids[:n]
        start = b.positions[:n].view(bucket, q)[:, 0]
        rope = (start[:, None] + t.depth[:bucket]).reshape(-1)
        meta = UniformMetadata(b.slot_mapping[:n], tables, b.seq_lens[:bucket], q, tree_mask=t.mask[:bucket].bool())
        with record_function("tree:target"):
            hidden, features = self.target.forward_features(ids, rope, self.cache, meta)
        with record_function("tree:accept"):
            tokens = ids.view(bucket, q)
            n_acc, path, bonus = self._accept(tokens, hidden, slots, bucket=bucket, mode=mode)
        branch = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)  # [bucket, D+1] nodes, the root first
        emitted = torch.cat([tokens.gather(1, path), bonus[:, None]], dim=1)
        emitted = emitted.scatter(1, n_acc[:, None], bonus[:, None])  # the bonus right after the accepted drafts
        rows = (branch + torch.arange(bucket, device=ids.device)[:, None] * q).reshape(-1)
        pos = (start[:, None] + torch.arange(d + 1, device=ids.device)[None, :]).reshape(-1)
        chain = self.drafter.chain
        rerun = UniformMetadata(slots[:, : d + 1].reshape(-1), tables, start + d + 1, d + 1)
        with record_function("tree:draft_rerun"):
            dh = chain.head.step(
                chain.shared, emitted.reshape(-1), hidden=features[rows], positions=pos, cache=chain.cache, meta=rerun
            )
        roots = start + n_acc
        h0 = dh.view(bucket, d + 1, -1).gather(1, n_acc[:, None, None].expand(-1, 1, dh.shape[-1]))[:, 0]
        with record_function("tree:grow"):
            drafts, parents, _ = self.drafter.grow(h0, roots, self._round_meta(tables, roots))
        verified = t.depth[:bucket].max(dim=1).values  # the depth of each tree verified here
        columns = [emitted, n_acc[:, None], drafts, parents, (roots + 1)[:, None], verified[:, None]]
        return torch.cat([c.to(torch.long) for c in columns], dim=1)  # laid out as `self.columns` says

    def _accept(
        self, tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor, bucket: int, mode: SamplingMode
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The walk over the trees (over the argmax, or over the target's keyed draws with the buffers' parameters),
        then the accepted branches' target KV moved to consecutive slots."""
        d, q, parents = self.depth, self.q_len, self.trees.parents[:bucket]
        if mode is SamplingMode.GREEDY:
            choice = self.target.greedy_tokens(hidden).view(bucket, q)
        else:
            b = self.buffers
            probs = processed_probs(
                self.target.logits(hidden),
                b.temperature[:bucket].repeat_interleave(q),
                b.top_k[:bucket].long().repeat_interleave(q),
                b.top_p[:bucket].repeat_interleave(q),
                filtered=mode is SamplingMode.FILTERED,
            ).view(bucket, q, -1)
            choice = tree_draws(probs, b.thresholds(bucket, d + 1), self.trees.depth[:bucket])
        if self.forced is not None:  # greedy steps only (replays refuse sampling requests)
            n_acc, path, bonus = forced_walk(self.forced.rows(bucket), choice, d)
        elif tree_kernels_apply(tokens):
            n_acc, path, bonus, src, dst = tree_kernels.greedy_walk_moves(tokens, parents, choice, slots, depth=d)
            self.cache.move(src.reshape(-1), dst.reshape(-1))
            return n_acc, path, bonus
        else:
            n_acc, path, bonus = greedy_walk(tokens, parents, choice, d)
        steps = torch.arange(1, d + 1, device=tokens.device)
        dst = slots[:, 1 : d + 1]
        src = torch.where(steps[None, :] <= n_acc[:, None], slots.gather(1, path), dst)
        self.cache.move(src.reshape(-1), dst.reshape(-1))
        return n_acc, path, bonus

    def _round_meta(self, tables: torch.Tensor, roots: torch.Tensor) -> MetaFor:
        """Metadata of each expansion round: its frontier rows' slots past the roots, and their visibility."""
        w, block_size = self.drafter.width, self.cache.block_size
        _, slots = chain_slots(roots, tables, block_size, max(1, (self.drafter.depth - 1) * w))  # [rounds*w, B]

        def meta_for(r: int, visible: torch.Tensor) -> Metadata:
            rows = slots[(r - 1) * w : r * w].t().reshape(-1)
            return UniformMetadata(rows, tables, roots + 1 + r * w, w, tree_mask=visible)

        return meta_for

    def warm_up(self) -> None:
        """Compile the launched-input kernel before serving (its first call would otherwise stall the first
        launched tree step); leaves the buffers padded."""
        b = self.buffers
        previous = torch.zeros(b.max_batch, self.columns.width, dtype=torch.long, device=b.input_ids.device)
        b.fill([], [], [], b.max_batch)
        self.trees.fill_launched(b.max_batch, b.max_batch)
        self._advance(previous, b.max_batch)
        b.fill([], [], [], b.max_batch)
        self.trees.fill(np.zeros((0, self.q_len), dtype=np.int64), b.max_batch)

    def time_steps(self, repeats: int = 10) -> dict[int, float]:
        """Seconds per greedy step by batch bucket, each the mean of `repeats` runs over padded buffers (which
        write only the scratch block): the tree's step costs for adaptive speculation."""
        out: dict[int, float] = {}
        self.buffers.fill([], [], [], self.buffers.max_batch)
        self.trees.fill(np.zeros((0, self.q_len), dtype=np.int64), self.buffers.max_batch)
        for bucket in self.steps.sizes:
            run = partial(self.steps.run, bucket, SamplingMode.GREEDY)
            run()  # warm-up
            out[bucket] = time_call(run, repeats, self.buffers.input_ids.device)
        return out

    def bucket_for(self, plan: StepPlan) -> int | None:
        """A bucket when every request is a generation row with a tree of exactly the budget that fits."""
        return uniform_bucket(plan, self.q_len, self.buffers.max_blocks, self.steps.sizes, trees=True)

    def launch(
        self, plan: StepPlan, bucket: int, keys: list[int] | None = None, after: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fill the buffers and replay without waiting; returns the device results [m, columns.width] of the
        real rows (`ResultColumns`; valid until the next run). `keys` are the requests' sampling keys; None
        for an all-greedy step. With `after` (a previous tree launch's results),
        each sequence's token_ids[0] is its row there, and its tokens, positions and tree are taken from that
        row on the device (the plan's drafts and parents are placeholders)."""
        seqs = plan.seqs
        self.buffers.fill([s.token_ids for s in seqs], [s.start for s in seqs], [s.block_ids for s in seqs], bucket)
        if after is None:
            self.trees.fill(np.array([[-1, *(s.draft_parents or [])] for s in seqs], dtype=np.int64), bucket)
        else:
            self.trees.fill_launched(len(seqs), bucket)
        if self.forced is not None:
            self.forced.fill(seqs, bucket)
        mode = SamplingMode.GREEDY
        if keys is not None:
            self.buffers.fill_sampling(
                [s.temperature for s in seqs],
                [s.top_k for s in seqs],
                [s.top_p for s in seqs],
                keys=keys,
                bucket=bucket,
            )
            mode = sampling_mode(seqs)
        if after is not None:
            self._advance(after, len(seqs))
        self.runs += 1
        return self.steps.run(bucket, mode)[: len(seqs)]  # type: ignore[no-any-return]

    def _advance(self, previous: torch.Tensor, m: int) -> None:
        advance = tree_kernels.advance_trees if tree_kernels_apply(previous) else advance_trees
        advance(previous, self.columns, self.buffers, self.trees, m=m)

    def read(self, plan: StepPlan, host: torch.Tensor) -> TargetOutput:
        """Tokens, accept counts and the next trees from a launch's results, copied to the host."""
        c = self.columns
        rows = host[:, : c.accepted + 1].tolist()
        depths = host[:, c.verified_depth].tolist()
        results = [  # drafted: the tree's depth, or a replayed branch's length when that is longer
            SeqResult(s.request_id, row[: row[c.accepted] + 1], max(depth, row[c.accepted]), row[c.accepted])
            for s, depth, row in zip(plan.seqs, depths, rows, strict=True)
        ]
        tokens, parents = host[:, c.drafts].clone(), host[:, c.parents].clone()  # `host` may be reused later
        proposals = DraftOutputs(plan.step_id, [s.request_id for s in plan.seqs], tokens, draft_parents=parents)
        return TargetOutput(plan.step_id, results, None, proposals)

    def run(self, plan: StepPlan, bucket: int, keys: list[int] | None = None) -> TargetOutput:
        """Launch, then read back tokens, accept counts and the next trees in one copy."""
        return self.read(plan, self.launch(plan, bucket, keys).cpu())
