"""Target model runner: one forward over a StepPlan, then sampling/verification and the draft's inputs."""

from __future__ import annotations

from collections import defaultdict

import torch

from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.logits_processing import (
    emitted_logprobs,
    min_p_filter,
)
from mtpserve.speculative.messages import DraftInputs, DraftOutputs, SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.sampling import (
    SamplingMode,
    keyed_thresholds,
    processed_probs,
    sample_at_threshold,
    sampling_key,
    sampling_mode,
)
from mtpserve.speculative.tree import DraftTree, forced_walk
from mtpserve.speculative.verify import ForcedAcceptance, forced_chain, verify, verify_greedy
from mtpserve.workers.captured_steps import CapturedSteps, LaunchableStep
from mtpserve.workers.eager_rows import Verified, processed_logits
from mtpserve.workers.joined_step import joinable, prompt_results, without_drafted
from mtpserve.workers.launch_spec import LaunchedStep, LaunchSpec
from mtpserve.workers.step_buffers import HOST_TWINS
from mtpserve.workers.tree_verify import accept, branch_moves, move_branches, plan_trees, tree_positions
from mtpserve.workers.uniform_step import pack_verified, read_verified, token_results


def _sub_plan(plan: StepPlan, seqs: list[SeqPlan]) -> StepPlan:
    """The same step restricted to some of its rows."""
    return StepPlan(plan.step_id, seqs, plan.num_draft_tokens)


class TargetRunner:
    """Owns one rank's model and KV cache; every rank computes the same tokens (logits are gathered)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        device: torch.device | str,
        *,
        steps: CapturedSteps | None = None,
        drafting: bool = False,
        lookahead_source: str = "prompt",
        replay: ForcedAcceptance | None = None,
    ):
        self.model = model
        self.steps = steps or CapturedSteps()
        self.replay = replay  # benchmarks only: greedy verify steps accept what it forces (speculative/replay.py)
        self.drafting = drafting  # a draft follows this target: every step's rows go to it, even at depth 0
        self.steps_ahead: int | None = None  # the engine's config chooses (a remote target says its own)
        self.cache = cache
        self.device = torch.device(device)
        self.lookahead_source = lookahead_source
        self._keys: dict[str, int] = {}  # each request's sampling key (`sampling_key`)
        self._results: dict[int, list[torch.Tensor]] = {}  # by width: HOST_TWINS host buffers for results, rotating
        self._spec = self._build_launch_spec()

    def discard(self) -> None:
        """Nothing to forget: steps launched in this process go with the engine's queue."""

    def shutdown(self) -> None:
        """Nothing to release in process."""

    def _key(self, sp: SeqPlan) -> int:
        key = self._keys.get(sp.request_id)
        if key is None:
            key = self._keys[sp.request_id] = sampling_key(sp.seed)
        return key

    def _thresholds(self, seqs: list[SeqPlan], offsets: list[list[int]]) -> torch.Tensor:
        """Keyed thresholds [len(seqs), n] of positions start + offset for each sequence (its rows' offsets)."""
        keys = torch.tensor([[self._key(s)] for s in seqs], dtype=torch.long)
        positions = torch.tensor([[s.start + o for o in offs] for s, offs in zip(seqs, offsets, strict=True)])
        return keyed_thresholds(keys, positions).to(self.device)

    @torch.no_grad()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Hidden states [T, d] for every scheduled row (writes the target KV)."""
        return self.forward_features(plan)[0]

    @torch.no_grad()
    def forward_features(
        self, plan: StepPlan, trees: list[DraftTree | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, d] and the draft's features [T, n*d] for every scheduled row (writes the KV);
        rows of a draft tree (`plan_trees`, computed here when not given) attend along their branches."""
        dev = self.device
        ids = torch.tensor([t for s in plan.seqs for t in s.token_ids], dtype=torch.long, device=dev)
        trees = plan_trees(plan.seqs) if trees is None else trees
        args = (
            [s.start for s in plan.seqs],
            [len(s.token_ids) for s in plan.seqs],
            [s.block_ids for s in plan.seqs],
            self.cache.block_size,
            dev,
        )
        masks = [None if t is None else t.ancestor_mask() for t in trees] if any(t is not None for t in trees) else None
        meta = ragged_metadata(*args, masks)
        positions = tree_positions(plan.seqs, trees).to(dev)
        return self.model.forward_features(ids, positions, self.cache, meta)

    @property
    def joins(self) -> bool:
        """Whether `launch` takes arriving requests' prompts ahead of a step's generation rows."""
        return self._spec is not None and self.steps.prefill is not None

    def launch_spec(self) -> LaunchSpec | None:
        """What `launch` queues: generation steps through the fused chain step and tree steps through the tree
        step when the draft is colocated, else target-only steps through the target step; None when it queues
        nothing."""
        return self._spec

    def _build_launch_spec(self) -> LaunchSpec | None:
        tree, target, chain = self.steps.tree, self.steps.target, self.steps.chain_steps()
        trees: tuple[int, int, tuple[int, ...]] = (0, 0, ())
        if tree is not None:
            trees = (tree.q_len - 1, tree.buffers.max_blocks, tuple(tree.steps.sizes))
        if chain:
            depths, blocks = tuple(c.k for c in chain), tuple(c.buffers.max_blocks for c in chain)
            return LaunchSpec(depths, blocks, tuple(chain[0].steps.sizes), *trees)
        if tree is not None:
            return LaunchSpec((), (), (), *trees)
        if target is None or self.drafting or target.q_len != 1:
            return None
        return LaunchSpec((0,), (target.buffers.max_blocks,), tuple(target.steps.sizes))

    @torch.no_grad()
    def launch(self, plan: StepPlan, after: LaunchedStep | None = None) -> LaunchedStep | None:
        """Queue a generation step of captured shape without waiting for it, with arriving requests' whole
        prompts ahead of its generation rows if any (`joined_step.py`); None for any other plan (run it with
        `execute`). With `after`, each generation row's token_ids[0] holds its row in `after`'s plan, and its
        inputs (tokens, and positions when drafting; a tree step's trees) come from that step's results on the
        device; `after` need not have finished, and must be a step of the same kind (a tree step after a tree
        step). Read with `collect`."""
        spec = self.launch_spec()
        if spec is None or not plan.seqs:
            return None
        chunks = plan.num_chunks
        gen = _sub_plan(plan, plan.seqs[chunks:]) if chunks else plan
        bucket = spec.bucket_for(gen) if gen.seqs else 0
        tree = spec.is_tree(plan)
        chain = self.steps.chain is not None
        replays = joinable(self.steps.prefill, plan, chunks, chain) if chunks else []
        if bucket is None or replays is None or (chunks and (tree or plan.num_draft_tokens not in spec.depths)):
            return None
        if after is not None and after.tree != tree:
            raise ValueError(f"step {plan.step_id}: a launched step reads the results of a step of its own kind")
        for rid in plan.finished_request_ids:
            self._keys.pop(rid, None)
        parts = []
        for members, prefill_bucket in replays:  # each read into `parts` before the next replay overwrites it
            prefill, seqs = self.steps.prefill, [plan.seqs[i] for i in members]
            assert prefill is not None  # joinable found its replays
            first = prefill.launch(_sub_plan(plan, seqs), prefill_bucket, self._context_keys(seqs))
            parts.append(prompt_results(first, seqs, plan.num_draft_tokens, chain))
        if gen.seqs:
            parts.append(self._replay(gen, bucket, tree, None if after is None else after.results))
        results = parts[0] if len(parts) == 1 else torch.cat(parts)
        m, width = results.shape
        ring = self._results.get(width)
        if ring is None:
            pin = self.device.type == "cuda"
            ring = self._results[width] = [
                torch.zeros((self.steps.max_batch(), width), dtype=torch.long, pin_memory=pin)
                for _ in range(HOST_TWINS)
            ]
        ring.append(ring.pop(0))
        host = ring[-1][:m]
        host.copy_(results, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(plan, results, host, ready, tree=tree, chunks=chunks)

    def _replay(self, plan: StepPlan, bucket: int, tree: bool, previous: torch.Tensor | None) -> torch.Tensor:
        """Replay the captured generation step for `plan` without waiting: its device results."""
        launchable: LaunchableStep | None = self.steps.tree if tree else self.steps.chain
        if launchable is not None:
            return launchable.launch(plan, bucket, self.keys(plan), previous)
        assert self.steps.target is not None  # a spec without tree or chain steps takes target-only steps
        tokens = None if previous is None else previous[:, 1]
        return self.steps.target.run(plan, bucket, self.keys(plan), tokens)[1]

    def collect(self, step: LaunchedStep) -> TargetOutput:
        """Wait for a launched step and return its tokens (and, with the fused or tree step, the next drafts)."""
        if step.ready is not None:
            step.ready.synchronize()
        launchable: LaunchableStep | None = self.steps.tree if step.tree else self.steps.chain
        if launchable is not None:
            out = launchable.read(step.plan, step.host)
        else:
            out = token_results(step.plan, step.host.tolist())
        return without_drafted(out, step.chunks) if step.chunks else out

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> TargetOutput:
        """Run the step: forward, sample final context rows, verify drafts, and build DraftInputs."""
        for rid in plan.finished_request_ids:
            self._keys.pop(rid, None)
        if not plan.seqs:
            return TargetOutput(plan.step_id, [])
        if any(s.processing is not None for s in plan.seqs):
            return self._run_eager(plan, plan_trees(plan.seqs))
        split = self.split_buckets(plan)
        if split is not None:
            return self.run_split(plan, *split)
        q_len = len(plan.seqs[0].token_ids)
        for step in self.steps.generation():
            if (step_bucket := step.bucket_for(plan)) is not None:
                return step.run(plan, step_bucket, self.keys(plan))
        target = self.steps.target
        bucket = target.bucket_for(plan) if target is not None else None
        trees = plan_trees(plan.seqs)
        if target is None or bucket is None:
            return self._run_eager(plan, trees)
        tokens: list[list[int]] = [[] for _ in plan.seqs]
        accepted = [0] * len(plan.seqs)
        last_token = [0] * len(plan.seqs)
        features, packed = target.run(plan, bucket, self.keys(plan))
        starts = [i * q_len for i in range(len(plan.seqs))]
        read_verified(packed, range(len(plan.seqs)), tokens, accepted, last_token=last_token)
        return self._output(plan, trees, features, Verified(tokens, accepted, last_token, starts))

    def _run_eager(self, plan: StepPlan, trees: list[DraftTree | None]) -> TargetOutput:
        """The step as one ragged forward (no captured step), then sampling and verification in eager torch."""
        n = len(plan.seqs)
        done = Verified([[] for _ in plan.seqs], [0] * n, [0] * n, [])
        hidden, features = self.forward_features(plan, trees)
        self._eager_verify(plan, trees, hidden, done)
        return self._output(plan, trees, features, done)

    def _output(
        self, plan: StepPlan, trees: list[DraftTree | None], features: torch.Tensor, done: Verified
    ) -> TargetOutput:
        drafted = [0 if s.is_context else s.num_draft_tokens for s in plan.seqs]
        for i, tree in enumerate(trees):
            if tree is not None:  # one branch is checked: stats count tree depth (or a longer replayed branch)
                drafted[i] = max(int(tree.depth().max()), done.accepted[i])
        results = [
            SeqResult(s.request_id, done.tokens[i], drafted[i], done.accepted[i], logprobs=done.logprobs.get(i))
            for i, s in enumerate(plan.seqs)
        ]
        draft_inputs = None
        if plan.num_draft_tokens > 0 or self.drafting:
            draft_inputs = self._draft_inputs(
                plan, features, done.starts, done.accepted, last_token=done.last_token, paths=done.paths
            )
        return TargetOutput(plan.step_id, results, draft_inputs)

    def split_buckets(self, plan: StepPlan) -> tuple[list[tuple[list[int], int]], int | None] | None:
        """([(rows of prompt chunks replayed together, their prefill bucket), ...], the generation rows' bucket or
        None when there are none) when the step's prompt chunks fit the captured prefill step's replays
        (`CapturedPrefill.groups`) and its generation rows, if any, the captured generation steps; else None."""
        ctx, prefill = [i for i, s in enumerate(plan.seqs) if s.is_context], self.steps.prefill
        if prefill is None or not ctx:
            return None
        groups = prefill.groups([plan.seqs[i] for i in ctx])
        if groups is None:
            return None
        chunks = [([ctx[j] for j in group], bucket) for group, bucket in groups]
        if len(ctx) == len(plan.seqs):
            return chunks, None
        gen, spec = _sub_plan(plan, [s for s in plan.seqs if not s.is_context]), self.launch_spec()
        gen_bucket = None if spec is None or spec.is_tree(gen) else spec.bucket_for(gen)  # tree steps run whole
        return None if gen_bucket is None else (chunks, gen_bucket)

    def run_split(self, plan: StepPlan, chunks: list[tuple[list[int], int]], gen_bucket: int | None) -> TargetOutput:
        """A step of prompt chunks (and generation rows) as fixed-shape steps: the chunks through the captured
        prefill step (several to a replay), then the generation rows through the captured generation step, all
        queued before anything is read; results in the plan's order.

        Requests A (a prompt chunk), B and C (decoding, K=3) and D (a prompt chunk): prefill(A, D), then one
        generation step over [B, C]; results [A, B, C, D]; draft outputs those of A, D, B, C."""
        prefill = self.steps.prefill
        assert prefill is not None  # split_buckets found the chunks' buckets in it
        if len(chunks) == 1 and gen_bucket is None:
            return prefill.run(plan, chunks[0][1], self._context_keys(plan.seqs))
        results: list[SeqResult | None] = [None] * len(plan.seqs)
        launched = []
        for members, bucket in chunks:
            sub = _sub_plan(plan, [plan.seqs[i] for i in members])
            out = prefill.launch(sub, bucket, self._context_keys(sub.seqs))
            launched.append((sub, members, out.clone() if len(chunks) > 1 else out))  # a later replay overwrites it
        drafts = []
        rest = None
        if gen_bucket is not None:
            rows = [i for i, s in enumerate(plan.seqs) if not s.is_context]
            gen = _sub_plan(plan, [plan.seqs[i] for i in rows])
            if self.steps.chain is not None:
                rest = self.steps.chain.run(gen, gen_bucket, self.keys(gen))
            else:
                assert self.steps.target is not None
                rest = token_results(gen, self.steps.target.run(gen, gen_bucket, self.keys(gen))[1].tolist())
            for i, r in zip(rows, rest.results, strict=True):
                results[i] = r
        for sub, members, out in launched:
            read = prefill.read(sub, out.tolist())
            for i, r in zip(members, read.results, strict=True):
                results[i] = r
            drafts.append(read.draft_outputs)
        if rest is not None:
            drafts.append(rest.draft_outputs)
        done = [r for r in results if r is not None]
        assert len(done) == len(results)
        made = [d for d in drafts if d is not None]
        if not made:
            return TargetOutput(plan.step_id, done)
        ids = [r for d in made for r in d.request_ids]
        proposed = [d.draft_token_ids.reshape(len(d.request_ids), -1) for d in made if d.request_ids]
        tokens = torch.cat(proposed) if proposed else torch.zeros((0, plan.num_draft_tokens), dtype=torch.long)
        return TargetOutput(plan.step_id, done, None, DraftOutputs(plan.step_id, ids, tokens))

    def _context_keys(self, seqs: list[SeqPlan]) -> list[int] | None:
        """Each chunk's sampling key where it is a sampling final chunk (its first token's draw), else 0; None
        when none is."""
        if all(s.temperature <= 0 or not s.is_final_chunk for s in seqs):
            return None
        return [self._key(s) if s.temperature > 0 and s.is_final_chunk else 0 for s in seqs]

    def _eager_verify(
        self,
        plan: StepPlan,
        trees: list[DraftTree | None],
        hidden: torch.Tensor,
        done: Verified,
    ) -> None:
        """Sample final context rows and verify generation rows of a ragged step: fills `done` (each sequence's
        tokens, accepted count, last token and first hidden row, each tree's accepted nodes, and the logprobs of
        sequences that ask for them)."""
        tokens, accepted, last_token = done.tokens, done.accepted, done.last_token
        starts = done.starts  # first hidden row of each sequence
        spans: list[tuple[int, int]] = []  # each sequence's rows in `logits`
        logit_rows: list[int] = []
        off = 0
        for s in plan.seqs:
            n = len(s.token_ids)
            starts.append(off)
            picked = [off + n - 1] if s.is_context else list(range(off, off + n))
            spans.append((len(logit_rows), len(logit_rows) + len(picked)))
            logit_rows.extend(picked)
            off += n
        raw = self.model.logits(hidden[torch.tensor(logit_rows, device=self.device)])
        logits = processed_logits(plan, raw, spans)
        self._verify_trees(plan, trees, logits, spans, done=done)
        groups: dict[tuple[bool, int], list[int]] = defaultdict(list)
        for i, s in enumerate(plan.seqs):
            if trees[i] is not None:
                continue
            groups[(s.temperature <= 0, -1 if s.is_context else s.num_draft_tokens)].append(i)
        for (greedy, k), members in groups.items():
            lg = logits[torch.tensor([list(range(*spans[i])) for i in members], device=self.device)]
            if k == -1:
                toks = self._sample_context(plan, members, lg[:, 0], greedy)
                for i, t in zip(members, toks, strict=True):
                    last_token[i] = t
                    tokens[i] = [t] if plan.seqs[i].is_final_chunk else []
                continue
            drafts = torch.tensor([plan.seqs[i].token_ids[1:] for i in members], dtype=torch.long, device=self.device)
            if self.replay is not None:  # refuses sampling requests; at depth 0 it only moves the requests on
                forced = self.replay.take([plan.seqs[i] for i in members], k + 1)
                n_acc, out = forced_chain(lg.argmax(-1), drafts, torch.from_numpy(forced).to(self.device))
            elif greedy:
                n_acc, out = verify_greedy(lg.argmax(-1), drafts)
            else:
                n_acc, out = self._verify_sampling(plan, members, lg, drafts)
            read_verified(pack_verified(n_acc, out), members, tokens, accepted, last_token=last_token)
        for i, s in enumerate(plan.seqs):
            if s.processing is not None and s.processing.logprobs >= 0 and tokens[i]:
                rows = torch.tensor([0, *done.paths.get(i, range(1, len(tokens[i])))], device=self.device)
                done.logprobs[i] = emitted_logprobs(raw[rows + spans[i][0]], tokens[i], s.processing.logprobs)

    def _verify_trees(
        self,
        plan: StepPlan,
        trees: list[DraftTree | None],
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        done: Verified,
    ) -> None:
        """Accept along one branch of each draft tree (into `done`), and move the accepted branches' KV into
        place."""
        moves = []
        for i, tree in enumerate(trees):
            if tree is None:
                continue
            s, lg = plan.seqs[i], logits[spans[i][0] : spans[i][1]]
            greedy = s.temperature <= 0
            if self.replay is not None:  # refuses sampling requests
                path, bonus = self._replayed_branch(s, tree, lg)
            else:
                probs = None if greedy else self._probs([s], lg)
                depths = [list(range(1, int(tree.depth().max()) + 2))]
                path, bonus = accept(tree, lg, probs, None if greedy else self._thresholds([s], depths)[0])
            done.paths[i] = path
            done.tokens[i] = [s.token_ids[n] for n in path] + [bonus]
            done.accepted[i], done.last_token[i] = len(path), bonus
            moves.append(branch_moves(s, path, self.cache.block_size))
        move_branches(self.cache, moves, self.device)

    def _replayed_branch(self, s: SeqPlan, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        """(accepted nodes, bonus token) of one tree as the replay forces them (`forced_walk`, as in the
        captured tree step)."""
        assert self.replay is not None
        forced = torch.from_numpy(self.replay.take([s], tree.size)).to(self.device)
        n_acc, path, bonus = forced_walk(forced, logits.argmax(-1)[None], tree.size - 1)
        return path[0, : int(n_acc[0])].tolist(), int(bonus[0])

    def keys(self, plan: StepPlan) -> list[int] | None:
        """Each request's sampling key for a captured step (which draws its thresholds on the device), or None
        when every request is greedy."""
        if all(s.temperature <= 0 for s in plan.seqs):
            return None
        return [self._key(s) if s.temperature > 0 else 0 for s in plan.seqs]

    def _sample_context(self, plan: StepPlan, members: list[int], logits: torch.Tensor, greedy: bool) -> list[int]:
        """Final chunks sample their first token; non-final chunks report the argmax guess (ablation only)."""
        out = logits.argmax(-1)
        final = [j for j, i in enumerate(members) if plan.seqs[i].is_final_chunk]
        if greedy or not final:
            return out.tolist()
        seqs = [plan.seqs[members[j]] for j in final]
        probs = self._probs(seqs, logits[final])
        u = self._thresholds(seqs, [[len(s.token_ids)] for s in seqs])[:, 0]
        out[final] = sample_at_threshold(probs, u)
        return out.tolist()

    def _probs(self, seqs: list[SeqPlan], logits: torch.Tensor) -> torch.Tensor:
        reps = logits.shape[0] // len(seqs)
        dev = self.device
        t = torch.tensor([s.temperature for s in seqs], device=dev).repeat_interleave(reps)
        k = torch.tensor([s.top_k for s in seqs], device=dev).repeat_interleave(reps)
        p = torch.tensor([s.top_p for s in seqs], device=dev).repeat_interleave(reps)
        probs = processed_probs(logits, t, k, p, filtered=sampling_mode(seqs) is SamplingMode.FILTERED)
        min_p = [0.0 if s.processing is None else s.processing.min_p for s in seqs]
        return min_p_filter(probs, torch.tensor(min_p, device=dev).repeat_interleave(reps))

    def _verify_sampling(
        self, plan: StepPlan, members: list[int], logits: torch.Tensor, drafts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [plan.seqs[i] for i in members]
        g, k1, v = logits.shape
        probs = self._probs(seqs, logits.reshape(g * k1, v)).reshape(g, k1, v)
        u = self._thresholds(seqs, [list(range(1, k1 + 1))] * len(seqs))
        q = None
        if all(s.draft_probs is not None for s in seqs):
            q = torch.stack([s.draft_probs for s in seqs]).to(self.device)  # type: ignore[misc]
        return verify(probs, drafts, u, q)

    def _draft_inputs(
        self,
        plan: StepPlan,
        hidden: torch.Tensor,
        starts: list[int],
        accepted: list[int],
        last_token: list[int],
        paths: dict[int, list[int]],
    ) -> DraftInputs:
        rows: list[int] = []
        seq_lens: list[int] = []
        positions: list[int] = []
        token_ids: list[int] = []
        for i, s in enumerate(plan.seqs):
            n = len(s.token_ids) if s.is_context else accepted[i] + 1
            picked = [0, *paths[i]] if i in paths else list(range(n))  # a tree: its accepted branch
            rows.extend(starts[i] + r for r in picked)
            seq_lens.append(n)
            positions.extend(range(s.start, s.start + n))
            token_ids.extend(s.token_ids[r] for r in picked)
        ctx = [s for s in plan.seqs if s.is_context]
        return DraftInputs(
            step_id=plan.step_id,
            request_ids=[s.request_id for s in plan.seqs],
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            seq_lens=seq_lens,
            is_context=[s.is_context for s in plan.seqs],
            lookahead_tokens=torch.tensor([s.lookahead_token for s in ctx], dtype=torch.long),
            sampled_tokens=torch.tensor(last_token, dtype=torch.long),
            hidden_states=hidden[torch.tensor(rows, device=hidden.device)],
            block_ids=[s.block_ids for s in plan.seqs],
            propose=[(not s.is_context) or s.is_final_chunk for s in plan.seqs],
            temperature=[s.temperature for s in plan.seqs],
            top_p=[s.top_p for s in plan.seqs],
            top_k=[s.top_k for s in plan.seqs],
            seed=[s.seed for s in plan.seqs],
            num_draft_tokens=plan.num_draft_tokens,
            lookahead_source=self.lookahead_source,
            finished_request_ids=list(plan.finished_request_ids),
        )
