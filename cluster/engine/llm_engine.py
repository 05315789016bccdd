"""In-process engine: request validation and the step loop over a target and a draft executor."""

from __future__ import annotations

import itertools
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from mtpserve.cluster.engine.chat_encoding import encode_text
from mtpserve.cluster.engine.errors import InvalidRequestError, ModelLoadError, QueueFullError
from mtpserve.cluster.engine.grammar import Grammars
from mtpserve.cluster.engine.request import Request
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.engine.sampling_params import SamplingParams, sampling_params
from mtpserve.cluster.engine.scheduler import Scheduler
from mtpserve.modeling.loader import resolve_device, to_dtype
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.messages import DraftInputs, DraftOutputs, StepPlan, TargetOutput
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs
from mtpserve.speculative.verify import ForcedAcceptance
from mtpserve.workers.builders import (
    bind_features,
    build_configured_target,
    build_draft,
    depth_policy,
    load_heads,
    load_target,
    max_model_len,
    num_blocks_for,
    tree_kind,
)
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.step_builders import TargetParts, build_runner


class TargetExecutor(Protocol):
    """Runs a StepPlan on the target (one process, or a TP group of actors)."""

    @property
    def drafting(self) -> bool:
        """Whether a draft follows the target (it may run inside the target's steps)."""
        ...

    @property
    def steps_ahead(self) -> int | None:
        """Steps a remote target keeps launched; None: the model config's choice."""
        ...

    def execute(self, plan: StepPlan) -> TargetOutput:
        """Forward, sample/verify, and return tokens plus the draft's inputs."""
        ...

    def discard(self) -> None:
        """Forget the steps launched ahead that a failed step dropped (a remote target owes their replies)."""
        ...

    def shutdown(self) -> None:
        """Release what the target holds (actors, process groups)."""
        ...


class Launched(Protocol):
    """A step launched on the device (in this process or on the ranks) whose tokens are not read yet."""

    plan: StepPlan


@runtime_checkable
class LaunchingTarget(Protocol):
    """A target that can queue a captured generation step before the one ahead of it has been read."""

    @property
    def joins(self) -> bool:
        """Whether launched steps may carry arriving requests' prompts (`Scheduler.plan_ahead`)."""
        ...

    def launch(self, plan: StepPlan, after: Any = None) -> Launched | None:
        """Launch `plan` (inputs from `after`'s results when given); None when it cannot be launched."""
        ...

    def collect(self, step: Any) -> TargetOutput:
        """Wait for a launched step and return its output."""
        ...


class DraftExecutor(Protocol):
    """Proposes drafts from DraftInputs (in process, or a draft worker actor)."""

    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Draft K tokens for the requests that asked."""
        ...

    def shutdown(self) -> None:
        """Release what the draft holds (a draft worker actor)."""
        ...


@dataclass
class Completion:
    """A finished request as returned by `generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats = field(default_factory=SpecStats)
    text: str = ""
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked for them

    def to_json(self) -> dict[str, Any]:
        """The `--json` contract: token_ids, text, finish_reason, stats."""
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


WARM_UP_BURST = 12  # prompts at once in `warm_up`, so that several chunks share a step


class LLMEngine:
    """Validates requests and runs `step()`: schedule, target forward+verify, draft propose, update."""

    def __init__(
        self,
        cfg: MTPServeConfig,
        args: LlamaArgs,
        scheduler: Scheduler,
        target: TargetExecutor,
        draft: DraftExecutor | None,
        tokenizer: Any = None,
    ) -> None:
        self.cfg = cfg
        self.args = args
        self.scheduler = scheduler
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self._grammar_compiler: Grammars | None = None
        self.max_model_len = scheduler.max_model_len
        self.totals = SpecStats()
        self.steps_run = 0  # steps applied, and the target rows they computed
        self.rows_run = 0
        self.steps_launched = 0  # of the steps applied, those launched ahead of the one before them being read
        self.kind_steps: Counter[str] = Counter()  # steps with generation rows, by kind ('0'..'K', 'tree<N>')
        self._kind_names: dict[int, str] = {}  # a step's draft count -> its kind's name
        self.health_listeners: list[Callable[[bool], None]] = []  # told when workers go down / come back
        self._ids = itertools.count()
        self._launcher: LaunchingTarget | None = None  # set when steps may be launched ahead (see `step`)
        self.use_target(target)
        self._launched: deque[Launched] = deque()  # launched steps whose tokens are not read yet (see `step`)
        self._period_start = 0.0  # when the last step began (`_observe_period`)
        self._read: tuple[int, int] | None = None  # (batch, draft count) of the launched step the last call read
        self._steady = False  # whether the step read before it was of the same kind
        self._refill = True  # plan ahead while fewer than `steps_ahead` steps follow the one to read
        # a remote target says how many steps it keeps launched; in process it is the model config's choice
        self.steps_ahead: int = target.steps_ahead or cfg.model.launched_ahead(remote=False)
        # Given, a step whose draft runs here after the target hands its tokens to this callback before the
        # draft proposes (the next step needs the drafts, the client does not), and `step` leaves them out.
        self.on_tokens: Callable[[list[RequestOutput]], None] | None = None

    def use_target(self, target: TargetExecutor) -> None:
        """Run steps on `target` from now on (nothing launched may be pending): launched ahead when the config
        allows and it can, with arrivals joining launched steps when it takes their prompts."""
        self.target = target
        cfg, speculative = self.cfg, self.draft is not None or target.drafting
        self._launcher = None
        if cfg.model.overlap_steps and (cfg.model.overlap_speculative or not speculative):
            self._launcher = target if isinstance(target, LaunchingTarget) else None
        launcher = self._launcher
        self.scheduler.join_ahead = cfg.scheduler.join_ahead and launcher is not None and launcher.joins

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls, cfg: MTPServeConfig, load_tokenizer: bool = True, replay: ForcedAcceptance | None = None
    ) -> LLMEngine:
        """Load the target (and draft) in this process; `replay` as in `from_weights`."""
        source, args, weights = load_target(cfg)
        tok = source.tokenizer() if load_tokenizer and not source.dummy else None
        return cls.from_weights(cfg, args, weights, tok, replay=replay)

    @classmethod
    def from_weights(
        cls,
        cfg: MTPServeConfig,
        args: LlamaArgs,
        weights: dict[str, torch.Tensor],
        tokenizer: Any = None,
        head: DraftHead | None = None,
        replay: ForcedAcceptance | None = None,
    ) -> LLMEngine:
        """Build from in-memory weights; `head` overrides the configured draft head. `replay` is for
        benchmarks only: greedy verify steps accept the recorded drafts it holds instead of comparing them
        with the target's tokens (`speculative/replay.py`), so the output is not the model's."""
        device = resolve_device(cfg.model.device)
        dtype = to_dtype(cfg.model.dtype, device)
        model = build_configured_target(cfg, args, weights, dtype, device=device)
        max_len = max_model_len(cfg, args)
        num_blocks = num_blocks_for(cfg, max_len)
        cache = model.allocate_cache(num_blocks, cfg.scheduler.block_size, device)
        heads = load_heads(cfg, args, weights) if head is None else [head]
        bind_features(model, heads)
        draft = (
            build_draft(cfg, heads, model, num_blocks, device=device, dtype=dtype) if cfg.speculative.enabled else None
        )
        spec = cfg.speculative
        k = spec.num_draft_tokens if draft is not None else 0
        target = build_runner(cfg, TargetParts(model, cache, torch.device(device), replay), draft, k, max_len=max_len)
        adaptive = spec.adaptive and isinstance(draft, (MTPEagleChain, MTPEagleTree))
        proposed, scratch = (spec.proposed_tokens, spec.scratch_slots) if draft is not None else (0, 0)
        tree = tree_kind(draft) if isinstance(draft, MTPEagleTree) else None  # adaptive: its chains' tree
        depth = depth_policy(cfg, k, target.steps.chain, tree=tree, tree_step=target.steps.tree) if adaptive else None
        sched = Scheduler(
            cfg.scheduler,
            num_blocks,
            proposed,
            eos_token_ids=args.eos_ids(),
            max_model_len=max_len,
            prefix_caching=cfg.prefix_caching,
            scratch_slots=scratch,
            depth=depth,
            tree=tree,
        )
        return cls(cfg, args, scheduler=sched, target=target, draft=draft, tokenizer=tokenizer)

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | dict[str, Any]) -> SamplingParams:
        """Check a request; raises InvalidRequestError naming the field and the reason."""
        if not isinstance(params, SamplingParams):
            params = sampling_params(params)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {n} tokens; the model's maximum length is {self.max_model_len} (prompt + output)",
            )
        vocab = self.args.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not 0 <= t < vocab:
                raise InvalidRequestError("prompt_token_ids", f"token id {t} at index {i} is outside [0, {vocab})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))):
            for t in ids:
                if not 0 <= t < vocab:
                    raise InvalidRequestError(name, f"token id {t} is outside [0, {vocab})")
        total = min(n + params.max_tokens, self.max_model_len)
        sched = self.scheduler
        if sched.blocks.blocks_for(sched.slots_needed(total + sched.k)) > sched.blocks.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens do not fit in the KV cache; lower max_tokens",
            )
        return params

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id."""
        params = self.validate(prompt_token_ids, params if params is not None else SamplingParams())
        if self.scheduler.num_waiting >= self.cfg.scheduler.max_queue:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting (scheduler.max_queue)")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"'{rid}' is already in flight")
        if params.seed is None and params.temperature > 0:
            # every TP rank then draws the same numbers: a tree's accepted branch decides which KV moves
            params = params.model_copy(update={"seed": secrets.randbits(62)})
        req = Request(rid, list(prompt_token_ids), params)
        if params.grammar is not None:
            req.grammar = self._grammars(params.grammar.field).matcher(params.grammar)
        self.scheduler.add(req)
        return rid

    def _grammars(self, field: str) -> Grammars:
        """The structured-output compiler for this engine's tokenizer, made at the first request that needs it."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError(field, "structured outputs need a model with a tokenizer")
            self._grammar_compiler = Grammars(self.tokenizer, self.args.vocab_size, self.args.eos_ids())
        return self._grammar_compiler

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """True while requests wait or run."""
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step over every running request.

        In steady decoding on captured steps (`model.overlap_steps`; speculative steps too with the draft
        in process, unless `model.overlap_speculative` is off), `steps_ahead` steps are launched on the device
        before this one's tokens are read, each with its inputs taken from the previous one's results on the
        device, so host work (and, over Ray, the ranks' round trip) overlaps GPU work. A request that stops
        at this step then computes up to `steps_ahead` extra steps, which are dropped. A step that raises
        drops the launched steps with it.

        Example, steps_ahead 2: with steps 10, 11 and 12 launched, this call waits for step 10 and returns its
        outputs while 11 and 12 run; the next call first queues 13 (planned by `plan_ahead` from 12, its
        tokens to come from 12's results on the device), then reads 11. If step 10 ends request A with a stop
        token, A's rows in 11 and 12 are computed anyway and `update` drops them; a request that arrives
        meanwhile waits until the queue is read and `schedule` runs again."""
        try:
            return self._step()
        except Exception:
            self._launched.clear()
            self._refill = True
            self.target.discard()
            raise

    def _step(self) -> list[RequestOutput]:
        runner = self._launcher
        started = time.perf_counter()
        if self._launched:
            self._observe_period(started)
        self._period_start = started
        if not self._launched:
            self._refill = True
            plan = self.scheduler.schedule(hold=self.steps_launched > 0)
            joins = self.scheduler.join_ahead or not plan.num_chunks  # prompt chunks launch only where arrivals may
            first = runner.launch(plan) if runner is not None and joins else None
            if first is None:
                self._read, self._steady = None, False  # a step run in turn: the next period is not a launched one
                return self._execute(plan)
            self._launched.append(first)
        assert runner is not None
        while self._refill and len(self._launched) <= self.steps_ahead:
            self._refill = self._queue_ahead(runner)
        current = self._launched.popleft()
        out = runner.collect(current)
        self.steps_launched += 1
        read = (len(current.plan.seqs), current.plan.num_draft_tokens)
        # a step whose prompts joined holds a prefill too: its period is not a steady one
        self._steady = self._read is not None and self._read[1] == read[1] and not current.plan.num_chunks
        self._read = read
        outputs = self._apply(current.plan, out, out.draft_outputs)
        if self._launched and not self.has_unfinished():
            self.drain()  # every request in the steps launched ahead has finished: wait for them now, not later
        return outputs

    def _observe_period(self, now: float) -> None:
        """Tell an adaptive policy with timed costs the period since the previous step began, when that step read a
        launched step of the same kind as the one read before it (steady decoding of one kind)."""
        policy = self.scheduler.depth
        if policy is None or policy.costs.online or self._read is None or not self._steady or not self._read[0]:
            return
        batch, count = self._read
        policy.costs.observe_period(batch, policy.kind_of(count), now - self._period_start)

    def _queue_ahead(self, runner: LaunchingTarget) -> bool:
        """Plan and launch the step after the last launched one; False when it goes through `schedule` instead
        (then nothing more is launched until the launched steps are read)."""
        last = self._launched[-1]
        ahead = self.scheduler.plan_ahead(last.plan, len(self._launched))
        if ahead is None:
            return False
        launched = runner.launch(ahead, last)
        if launched is None:
            self.scheduler.cancel_ahead(ahead)
            return False
        self._launched.append(launched)
        return True

    def drain(self) -> list[RequestOutput]:
        """Read and apply the steps launched ahead by `step`, if any, so that the scheduler's state is current
        (for callers that drive the scheduler and target directly)."""
        outputs: list[RequestOutput] = []
        while self._launched:
            assert self._launcher is not None  # the only one that queues steps
            launched = self._launched.popleft()
            out = self._launcher.collect(launched)
            self.steps_launched += 1
            outputs += self._apply(launched.plan, out, out.draft_outputs)
        return outputs

    def _execute(self, plan: StepPlan) -> list[RequestOutput]:
        policy = self.scheduler.depth
        if policy is None or not policy.costs.online or not plan.seqs or any(s.is_context for s in plan.seqs):
            return self._run(plan)
        t0 = time.perf_counter()
        outputs = self._run(plan)
        policy.costs.observe(len(plan.seqs), policy.kind_of(plan.num_draft_tokens), time.perf_counter() - t0)
        return outputs

    def _run(self, plan: StepPlan) -> list[RequestOutput]:
        out = self.target.execute(plan)
        if out.draft_outputs is not None or self.draft is None or out.draft_inputs is None:
            return self._apply(plan, out, out.draft_outputs)
        outputs = self._apply(plan, out, None)
        if self.on_tokens is not None and any(o.new_token_ids or o.finished for o in outputs):
            self.on_tokens(outputs)
            outputs = []
        self.scheduler.apply_drafts(self.draft.propose(out.draft_inputs))
        return outputs

    def _apply(self, plan: StepPlan, out: TargetOutput, drafts: DraftOutputs | None) -> list[RequestOutput]:
        outputs = self.scheduler.update(plan, out, drafts)
        self.steps_run += 1
        self.rows_run += plan.num_tokens
        if plan.seqs and not plan.seqs[-1].is_context:  # generation rows come last: a step that verifies
            name = self._kind_names.get(plan.num_draft_tokens)
            if name is None:
                name = self._kind_names[plan.num_draft_tokens] = str(self.scheduler.kind_of(plan.num_draft_tokens))
            self.kind_steps[name] += 1
        for o in outputs:
            if o.finished:
                self.totals.merge(o.stats)
        return outputs

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | dict[str, Any] | None = None
    ) -> list[Completion]:
        """Run prompts to completion (continuous batching); results in input order."""
        ids = [self.add_request(p, params) for p in prompts]
        prompts_by_id = {rid: self.scheduler.requests[rid].prompt_token_ids for rid in ids}
        done: dict[str, Completion] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, TokenLogprobs] = {}
        while self.has_unfinished():
            for o in self.step():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.logprobs is not None:
                    logprobs.setdefault(o.request_id, TokenLogprobs([], [], [])).extend(o.logprobs)
                if o.finished:
                    done[o.request_id] = Completion(
                        o.request_id,
                        prompts_by_id[o.request_id],
                        tokens[o.request_id],
                        o.finish_reason,
                        stats=o.stats,
                        logprobs=logprobs.get(o.request_id),
                    )
        for c in done.values():
            c.text = self.decode(c.token_ids)
        return [done[rid] for rid in ids]

    def warm_up(self, prompt_len: int = 128) -> None:
        """Run throw-away requests through the steps serving meets first: a burst of prompts in one step, prompt
        chunks beside decode rows, a sampled request; so that kernels compile (and caches fill) before the engine
        serves. Afterwards no block is held or cached, and the totals and prefix-cache counters read zero (an
        adaptive policy keeps the few decode steps it saw)."""
        vocab, n = self.args.vocab_size, max(1, min(WARM_UP_BURST, self.cfg.scheduler.max_queue - 2))
        length = max(2, min(prompt_len, self.max_model_len - 4))
        prompts = [[(7 + 31 * i + 17 * j) % vocab for j in range(length)] for i in range(n + 2)]
        greedy = SamplingParams(max_tokens=2, ignore_eos=True)
        for p in prompts[:n]:
            self.add_request(p, greedy)
        self.step()  # the burst's prompts, in one step where the budget allows
        self.add_request(prompts[n], greedy)  # a prompt beside decode rows
        self.add_request(prompts[n + 1], SamplingParams(max_tokens=2, temperature=0.8, seed=0, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        self.scheduler.forget_cached()
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0
        self.totals = SpecStats()

    def shutdown(self) -> None:
        """Release executors (actors, process groups); the in-process engine has nothing to release."""
        self.target.shutdown()
        if self.draft is not None:
            self.draft.shutdown()

    # ---- text ------------------------------------------------------------------------------------
    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for `text`, wrapped in the chat template unless chat is False."""
        if self.tokenizer is None:
            raise ModelLoadError("this engine has no tokenizer; pass token ids")
        return encode_text(self.tokenizer, text, chat)

    def decode(self, token_ids: list[int]) -> str:
        """Text for token ids (special tokens dropped); empty without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
