"""Context-chunk scheduler: token-budgeted continuous batching with chunked prefill and preemption."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from mtpserve.cluster.engine.admit_window import AdmitWindow
from mtpserve.cluster.engine.block_manager import BlockManager
from mtpserve.cluster.engine.prefix_cache import attach_cached, register_blocks
from mtpserve.cluster.engine.request import Request, RequestStatus
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.speculative.adaptive import AdaptiveDepth, StepKind
from mtpserve.speculative.draft_shapes import chain_as_tree, fit_drafts
from mtpserve.speculative.logits_processing import row_branches
from mtpserve.speculative.messages import DraftOutputs, SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.token_logprobs import TokenLogprobs
from mtpserve.workers.config import SchedulerConfig


class Scheduler:
    """Plans each step within `max_num_batched_tokens` and applies its results.

    Generation requests are scheduled first (1 + K rows each), then running context requests, then
    waiting ones, each context request taking at most `chunk_size` tokens from its cursor. When KV
    blocks run out, the most recently admitted request is preempted and later recomputes its context
    (prompt plus tokens generated so far).

    With an `AdaptiveDepth` policy each step has its own kind, a chain depth (at most K) or a draft tree: a
    request's stored drafts are cut to it, padded with copies of its last token when the step before
    proposed fewer, or reshaped when it proposed the other kind (`speculative/draft_shapes.py`). Padding is
    verified like any draft, so output is unchanged, and is left out of the acceptance counts.
    """

    def __init__(
        self,
        cfg: SchedulerConfig,
        num_blocks: int,
        num_draft_tokens: int,
        *,
        eos_token_ids: list[int],
        max_model_len: int,
        prefix_caching: bool | None = None,
        scratch_slots: int | None = None,
        depth: AdaptiveDepth | None = None,
        tree: StepKind | None = None,
    ) -> None:
        self.cfg = cfg
        self.depth = depth
        self.window = AdmitWindow(cfg.admit_wait_ms)  # when arrivals join a batch on launched steps
        self.join_ahead = False  # arrivals may join in `plan_ahead`'s steps (the engine sets it when its target can)
        self.tree = tree  # the draft tree of steps whose draft count is its budget (adaptive or not)
        self._ahead: set[int] = set()  # steps planned by `plan_ahead` whose results are not applied yet
        self._next_kind: StepKind | None = None  # a kind `plan_ahead` chose for the step `schedule` plans next
        self._real_drafts: dict[int, dict[str, int]] = {}  # step -> request -> real drafts, where padded or reshaped
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.prefix_caching = cfg.prefix_caching if prefix_caching is None else prefix_caching
        self.prefix_query_tokens = 0  # sequence tokens of admitted requests, looked up in the cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV came from the cache
        self.k = num_draft_tokens
        self.scratch_slots = num_draft_tokens if scratch_slots is None else scratch_slots
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_plan: list[str] = []
        self._step = 0
        self.num_preemptions = 0
        self.on_verify: Callable[[SeqPlan, SeqResult], None] | None = None  # told of every counted verify step

    # ---- admission -------------------------------------------------------------------------------
    def slots_needed(self, num_tokens: int) -> int:
        """KV slots a sequence of `num_tokens` needs, including the draft's writes past it (a chain's next
        drafts, or a tree's frontier rows)."""
        return num_tokens + self.scratch_slots

    def add(self, req: Request) -> None:
        """Queue a validated request."""
        p = req.params
        req.stop_set = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos))
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now and free its blocks; False if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, reason)
        return True

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (prefilling or decoding)."""
        return len(self.running)

    # ---- planning --------------------------------------------------------------------------------
    def schedule(self, hold: bool = False) -> StepPlan:
        """Choose this step's rows: generation first, then context chunks, within the token budget. With `hold`
        (steps are being launched ahead), waiting requests join only as `self.window` allows."""
        budget = self.cfg.max_num_batched_tokens
        gen: list[SeqPlan] = []
        ctx: list[SeqPlan] = []
        scheduled: set[str] = set()
        decoding = [r for r in self.running if not r.in_context and r.status is RequestStatus.RUNNING]
        kind = self._step_kind(len(decoding))
        padded: dict[str, int] = {}
        for req in decoding:
            if req.status is not RequestStatus.RUNNING:  # preempted by an earlier row's reservation
                continue
            n = 1 + (len(req.draft_token_ids) if kind is None else kind.num_draft_tokens)
            if n > budget:
                continue
            if not self._reserve(req, self.slots_needed(req.num_computed_tokens + n), scheduled):
                continue
            last = req.all_token_ids[-1]
            drafts, parents, probs = req.draft_token_ids, req.draft_parents, req.draft_probs
            if kind is not None:
                drafts, parents, real = fit_drafts(drafts, parents, kind, last)
                if real is not None:
                    padded[req.request_id] = real
            tokens = [last, *drafts]
            gen.append(self._gen_plan(req, tokens, req.num_computed_tokens, probs, draft_parents=parents))
            scheduled.add(req.request_id)
            budget -= n
        for req in list(self.running):
            if budget <= 0:
                break
            if not req.in_context or req.status is not RequestStatus.RUNNING:
                continue
            plan = self._chunk_plan(req, budget, scheduled, allow_preempt=True)
            if plan is not None:
                ctx.append(plan)
                scheduled.add(req.request_id)
                budget -= len(plan.token_ids)
        now = time.monotonic()
        if hold and not self.window.admit_now(self.waiting, len(gen), free_slots=self._free_slots, now=now):
            budget = 0  # they join a later step, and this one can be launched
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_requests:
            plan = self._admit(self.waiting[0], budget, scheduled, now)
            if plan is None:
                break
            ctx.append(plan)
            budget -= len(plan.token_ids)
        self._step += 1
        if padded:
            self._real_drafts[self._step] = padded
        finished, self._finished_since_plan = self._finished_since_plan, []
        return StepPlan(self._step, ctx + gen, self.k if kind is None else kind.num_draft_tokens, finished)

    def _admit(self, req: Request, budget: int, scheduled: set[str], now: float, whole: bool = False) -> SeqPlan | None:
        """Admit the first waiting request with its first prompt chunk (its cached prefix attached); None, and it
        keeps waiting, when the chunk does not fit the budget and free blocks, or with `whole` is not its last."""
        self._attach_cached(req)
        plan = self._chunk_plan(req, budget, scheduled, allow_preempt=False)
        if plan is None or (whole and not plan.is_final_chunk):
            self._release(req)
            return None
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += req.num_computed_tokens
        self.waiting.popleft()
        self.window.admitted_in = self._step + 1  # this plan's id
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = now
        self.running.append(req)
        scheduled.add(req.request_id)
        return plan

    def _unadmit(self, req: Request) -> None:
        """Undo `_admit` for a request whose planned step will not run: it waits first again, its blocks freed."""
        self.prefix_query_tokens -= req.num_tokens
        self.prefix_hit_tokens -= req.num_computed_tokens
        self._release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    @property
    def _free_slots(self) -> int:
        return self.cfg.max_num_requests - len(self.running)

    def _step_kind(self, batch: int) -> StepKind | None:
        """The adaptive policy's kind for the next step (what it verifies and proposes); None without one."""
        if self.depth is None:
            return None
        if self._next_kind is not None:
            kind, self._next_kind = self._next_kind, None
            return kind
        return self.depth.choose(batch)

    def kind_of(self, num_draft_tokens: int) -> StepKind:
        """The kind of a step whose requests carry `num_draft_tokens` drafts: the tree's budget, or a depth."""
        if self.depth is not None:
            return self.depth.kind_of(num_draft_tokens)
        if self.tree is not None and num_draft_tokens == self.tree.budget:
            return self.tree
        return StepKind(num_draft_tokens)

    def plan_ahead(self, pending: StepPlan, unapplied: int = 1) -> StepPlan | None:
        """The generation step after `pending`, the last of `unapplied` launched steps (each planned from the one
        before it) whose results are not applied yet; with `join_ahead`, waiting requests due to join
        (`admit_window.py`) come in it with their whole prompts as final chunks.

        Each continuing sequence's token_ids[0] holds its row in `pending`: its inputs (last token, and the
        drafts and position when speculating; a tree step's tree) come from that row's results on the device,
        and its drafts (and a tree's parents) here are placeholders. A request whose prompt chunk ends in
        `pending` continues from the first token that chunk samples. Requests that the unapplied steps surely
        finish (by max_tokens), or whose next positions could pass max_model_len, are left out; those they may
        finish (a stop token, or enough accepted drafts) stay in, and `update` drops their extra steps. Blocks
        grow for the most tokens the unapplied steps can accept (a tree's depth + 1 each). None
        when the step should go through `schedule` instead: waiting requests should join and cannot join here
        (a prompt longer than a chunk, logit rules, no room), requests run outside `pending` or mid-prompt in
        it, blocks would need a preemption, the kind changes, a request has logit rules (they read the output
        so far), or nothing is left to run.

        Example, K=3, pending = step 7 over requests A (row 0) and B (row 1), at positions 40 and 90, one step
        unapplied: step 8 plans A as token_ids [0, 0, 0, 0] (row 0 of step 7; three placeholder drafts) at start
        44 and B as [1, 0, 0, 0] at start 94, since step 7 emits at most K + 1 = 4 tokens each; A's blocks grow
        to hold positions up to 44 + 3. The runner reads A's last token and drafts from step 7's results row 0
        on the device. Had step 7 been A's last by max_tokens, A would be left out of step 8. Had C (a 20-token
        prompt) been due to join, step 8 would also hold C's chunk [c0..c19] at start 0, and step 9 would plan
        C as [row of C in step 8, 0, 0, 0] at start 20."""
        k = pending.num_draft_tokens
        planned = {sp.request_id for sp in pending.seqs}
        join = self.window.admit_now(self.waiting, len(pending.seqs), free_slots=self._free_slots, now=time.monotonic())
        if (join and not self.join_ahead) or any(r.request_id not in planned or r.processed for r in self.running):
            return None  # (logit rules read the output so far, which the unapplied steps have not brought)
        if any(sp.is_context and not sp.is_final_chunk for sp in pending.seqs):
            return None
        if self.depth is not None:
            kind = self._step_kind(len(pending.seqs))
            if kind != self.depth.kind_of(k):  # a new kind starts from `schedule`, the stored drafts fitted to it
                self._next_kind = kind
                return None
        kind = self.kind_of(k)
        drafts, parents = [0] * k, None
        if kind.is_tree:  # a valid tree of the kind's depth (siblings carry distinct tokens)
            drafts, parents = chain_as_tree([0] * kind.depth, kind.budget, kind.depth, kind.width)
        elif any(sp.draft_parents is not None for sp in pending.seqs):
            return None  # trees of a kind this scheduler was not told of
        seqs: list[SeqPlan] = []
        for row, sp in enumerate(pending.seqs):
            req = self.requests.get(sp.request_id)
            if (
                req is None
                or req.status is not RequestStatus.RUNNING
                or (not sp.is_context and len(sp.token_ids) != k + 1)
            ):
                continue
            if len(req.output_token_ids) + unapplied >= req.params.max_tokens or (
                req.num_tokens + kind.most_tokens * unapplied >= self.max_model_len
            ):
                continue
            if sp.is_context:  # its prompt ends in `pending`: the next step reads the token at its end
                start = sp.end
            elif req.in_context:  # its prompt ends in an earlier unapplied step, which `pending` follows
                start = sp.start + kind.most_tokens
            else:  # an upper bound (exact for target-only steps)
                start = req.num_computed_tokens + kind.most_tokens * unapplied
            if not self.blocks.grow(req.block_ids, self.slots_needed(start + k + 1)):
                return None
            seqs.append(
                self._gen_plan(
                    req, [row, *drafts], start, None, draft_parents=None if parents is None else list(parents)
                )
            )
        ctx: list[SeqPlan] = []
        if join:
            budget = self.cfg.max_num_batched_tokens - sum(len(sp.token_ids) for sp in seqs)
            while self.waiting and budget > 0 and self._free_slots > 0 and not self.waiting[0].processed:
                chunk = self._admit(self.waiting[0], budget, set(), time.monotonic(), whole=True)
                if chunk is None:
                    break
                ctx.append(chunk)
                budget -= len(chunk.token_ids)
            if not ctx:
                return None
        if not seqs and not ctx:
            return None
        self._step += 1
        self._ahead.add(self._step)
        finished, self._finished_since_plan = self._finished_since_plan, []
        return StepPlan(self._step, ctx + seqs, k, finished)

    def cancel_ahead(self, plan: StepPlan) -> None:
        """Give back a `plan_ahead` plan that will not run: its finished request ids go to the next plan, the
        requests it admitted wait again (the blocks it grew for running requests stay with them, which use them
        later)."""
        self._ahead.discard(plan.step_id)
        self._finished_since_plan[:0] = plan.finished_request_ids
        for sp in reversed(plan.seqs):
            if sp.is_context:
                self._unadmit(self.requests[sp.request_id])

    def _chunk_plan(self, req: Request, budget: int, scheduled: set[str], allow_preempt: bool) -> SeqPlan | None:
        start = req.num_computed_tokens
        seq = req.all_token_ids
        n = min(self.cfg.chunk_size, len(seq) - start, budget)
        if n <= 0:
            return None
        end = start + n
        final = end == len(seq)
        need = self.slots_needed(end) if final else end
        if allow_preempt:
            if not self._reserve(req, need, scheduled):
                return None
        elif not self.blocks.grow(req.block_ids, need):
            return None
        return SeqPlan(
            request_id=req.request_id,
            token_ids=seq[start:end],
            start=start,
            block_ids=list(req.block_ids),
            is_context=True,
            is_final_chunk=final,
            lookahead_token=-1 if final else seq[end],
            **req.params.row_fields,
            processing=req.processing([[]]) if final and req.processed else None,
        )

    def _gen_plan(
        self,
        req: Request,
        token_ids: list[int],
        start: int,
        draft_probs: torch.Tensor | None = None,
        draft_parents: list[int] | None = None,
    ) -> SeqPlan:
        """A generation row: token_ids are the last token (or, planned ahead, its row) and the drafts."""
        return SeqPlan(
            request_id=req.request_id,
            token_ids=token_ids,
            start=start,
            block_ids=list(req.block_ids),
            is_context=False,
            is_final_chunk=True,
            lookahead_token=-1,
            num_draft_tokens=len(token_ids) - 1,
            **req.params.row_fields,
            draft_probs=draft_probs,
            draft_parents=draft_parents,
            processing=req.processing(row_branches(token_ids, draft_parents, len(token_ids)))
            if req.processed
            else None,
        )

    def _reserve(self, req: Request, num_slots: int, scheduled: set[str]) -> bool:
        """Grow req's blocks to `num_slots`, preempting the latest unscheduled requests if needed."""
        while not self.blocks.grow(req.block_ids, num_slots):
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = victims[-1] if victims else req
            self.preempt(victim)
            if victim is req:
                return False
        return True

    # ---- prefix cache ----------------------------------------------------------------------------
    def _attach_cached(self, req: Request) -> None:
        if self.prefix_caching:
            attach_cached(self.blocks, req, self.cfg.block_size)

    def _register(self, req: Request) -> None:
        if self.prefix_caching:
            register_blocks(self.blocks, req, self.cfg.block_size)

    def _release(self, req: Request) -> None:
        """Give back a request's blocks and rewind its context cursor to the start."""
        self.blocks.free(req.block_ids)
        req.num_keyed_blocks = 0
        req.num_computed_tokens = 0

    def forget_cached(self) -> int:
        """Drop every prefix-cache key (the workers' KV contents were lost); returns how many there were."""
        for req in self.running:
            req.num_keyed_blocks = len(req.block_ids)  # their blocks stay theirs, but are never keyed again
        return self.blocks.forget()

    def preempt(self, req: Request) -> None:
        """Evict a running request: free its blocks; it later recomputes prompt + output from position 0
        (or from the end of its prefix still in the cache)."""
        self._release(req)
        req.in_context = True
        req.draft_token_ids, req.draft_probs, req.draft_parents = [], None, None
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)

    # ---- results ---------------------------------------------------------------------------------
    def update(self, plan: StepPlan, out: TargetOutput, drafts: DraftOutputs | None) -> list[RequestOutput]:
        """Apply a step's tokens and proposals; finish requests that hit a stop condition."""
        outputs: list[RequestOutput] = []
        real = self._real_drafts.pop(plan.step_id, {})
        kind = None if self.depth is None else self.depth.kind_of(plan.num_draft_tokens)
        ahead = plan.step_id in self._ahead
        self._ahead = {s for s in self._ahead if s > plan.step_id}  # (and those of steps dropped on a failure)
        if plan.step_id == self.window.admitted_in:
            self.window.joined_at = time.monotonic()
        for sp, res in zip(plan.seqs, out.results, strict=True):
            req = self.requests.get(sp.request_id)
            if req is None or req.finished or req.status is not RequestStatus.RUNNING:
                continue
            if (
                ahead and self.on_verify is not None and not sp.is_context
            ):  # what the step verified, in place of the placeholders
                tokens, parents = [req.all_token_ids[-1], *req.draft_token_ids], req.draft_parents
                sp = replace(sp, token_ids=tokens, start=req.num_computed_tokens, draft_parents=parents)
            if sp.is_context:
                req.num_computed_tokens = sp.end
                if not sp.is_final_chunk:
                    self._register(req)
                    continue
                req.in_context = False
            else:
                req.num_computed_tokens += 1 + res.num_accepted
                drafted = min(res.num_drafted, real.get(req.request_id, res.num_drafted))
                if drafted:
                    req.stats.record(drafted, min(res.num_accepted, drafted))
                    if self.on_verify is not None:
                        self.on_verify(sp, res)
                if self.depth is not None and kind is not None:
                    self.depth.record(kind, drafted, res.num_accepted, req.request_id in real)
            req.draft_token_ids, req.draft_probs, req.draft_parents = [], None, None
            outputs.append(self._append(req, res.new_token_ids, res.logprobs))
        if drafts is not None:
            self.apply_drafts(drafts)
        return outputs

    def apply_drafts(self, drafts: DraftOutputs) -> None:
        """Store a step's proposals for the next step (requests that finished or left are skipped)."""
        proposed = drafts.draft_token_ids.tolist()
        parents = None if drafts.draft_parents is None else drafts.draft_parents.tolist()
        for i, rid in enumerate(drafts.request_ids):
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING or req.in_context:
                continue
            req.draft_token_ids = proposed[i]
            req.draft_probs = None if drafts.draft_probs is None else drafts.draft_probs[i]
            req.draft_parents = None if parents is None else parents[i]

    def _append(self, req: Request, tokens: list[int], logprobs: TokenLogprobs | None = None) -> RequestOutput:
        p = req.params
        out = req.output_token_ids
        ended = False  # a grammar completed (structured outputs)
        if req.grammar is not None:
            keep = req.grammar.accept(tokens)
            tokens, ended = tokens[:keep], req.grammar.terminated
        room = min(p.max_tokens - len(out), self.max_model_len - req.num_tokens)
        if len(tokens) < room and req.stop_set.isdisjoint(tokens):
            out += tokens  # the common step: no stop token, and no limit reached
            emitted, reason = list(tokens), None
        else:
            emitted, reason = req.append_until_stop(tokens, self.max_model_len)
        if reason is None and ended:
            reason = "stop"
        self._register(req)
        if emitted and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if reason:
            self._finish(req, reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=emitted,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.output_token_ids),
            stats=req.stats,
            timings=req.timings() if reason else None,
            logprobs=None if logprobs is None else logprobs.head(len(emitted)),
        )

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        self.blocks.free(req.block_ids)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finished_since_plan.append(req.request_id)
        self.requests.pop(req.request_id, None)
