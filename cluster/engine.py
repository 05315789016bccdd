"""In-process engine: request validation, the step loop, and model/draft construction."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import ValidationError

from cluster.config import MTPServeConfig
from cluster.errors import InvalidRequestError, ModelLoadError, QueueFullError
from cluster.request import Request, SamplingParams
from cluster.scheduler import RequestOutput, Scheduler
from proto.messages import DraftInputs, DraftOutputs, StepPlan, TargetOutput
from speculative.chain_step import UniformChainStep
from speculative.lookahead import LookaheadBuffer
from speculative.methods import DraftMethod
from speculative.mtp_chain import MTPEagleChain
from speculative.mtp_head import MTPEagleHead
from speculative.stats import SpecStats
from workers.fused_step import FusedSpecStep
from workers.kv_cache import KVCache
from workers.layer_ops import pick_ops
from workers.loader import ModelSource, resolve_device, resolve_model, to_dtype
from workers.model import LlamaArgs, LlamaModel, prepare_for_inference
from workers.runner import LaunchedStep, TargetRunner, UniformTargetStep

log = logging.getLogger(__name__)
DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "speculative" / "heads" / "smollm2-135m-mtp.safetensors"


class TargetExecutor(Protocol):
    """Runs a StepPlan on the target (one process, or a TP group of actors)."""

    def execute(self, plan: StepPlan) -> TargetOutput:
        """Forward, sample/verify, and return tokens plus the draft's inputs."""
        ...


class DraftExecutor(Protocol):
    """Proposes drafts from DraftInputs (in process, or a draft worker actor)."""

    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Draft K tokens for the requests that asked."""
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

    def to_json(self) -> dict[str, Any]:
        """The `--json` contract: token_ids, text, finish_reason, stats."""
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def load_target(cfg: MTPServeConfig) -> tuple[ModelSource, LlamaArgs, dict[str, torch.Tensor]]:
    """Resolve the configured model and read its (full, unsharded) weights."""
    source = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir)
    return source, source.args(), source.weights(seed=cfg.model.seed)


def max_model_len(cfg: MTPServeConfig, args: LlamaArgs) -> int:
    """Prompt + output cap: the configured value, never above the model's positions."""
    return min(cfg.model.max_model_len or args.max_position_embeddings, args.max_position_embeddings)


def num_blocks_for(cfg: MTPServeConfig, max_model_len: int) -> int:
    """KV blocks to allocate: the configured count, or room for every slot plus one full-length request."""
    sc = cfg.scheduler
    if sc.num_kv_blocks:
        return sc.num_kv_blocks
    per_request = -(-256 // sc.block_size)
    full = -(-(max_model_len + 2 * cfg.speculative.num_draft_tokens) // sc.block_size)
    return max(sc.max_num_requests * per_request, full) + 1


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
        self.max_model_len = scheduler.max_model_len
        self.totals = SpecStats()
        self.health_listeners: list[Callable[[bool], None]] = []  # told when workers go down / come back
        self._ids = itertools.count()
        self._overlap_runner: TargetRunner | None = None  # set when steps may be queued ahead (see `step`)
        speculative = draft is not None
        if cfg.model.overlap_steps and (cfg.model.overlap_speculative or not speculative):
            self._overlap_runner = target if isinstance(target, TargetRunner) else None
        self._launched: LaunchedStep | None = None  # a queued step whose tokens are not read yet (see `step`)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: MTPServeConfig, load_tokenizer: bool = True) -> LLMEngine:
        """Load the target (and draft) in this process."""
        source, args, weights = load_target(cfg)
        tok = source.tokenizer() if load_tokenizer and not source.dummy else None
        return cls.from_weights(cfg, args, weights, tok)

    @classmethod
    def from_weights(
        cls,
        cfg: MTPServeConfig,
        args: LlamaArgs,
        weights: dict[str, torch.Tensor],
        tokenizer: Any = None,
        head: MTPEagleHead | None = None,
    ) -> LLMEngine:
        """Build from in-memory weights; `head` overrides the configured draft head."""
        device = resolve_device(cfg.model.device)
        dtype = to_dtype(cfg.model.dtype, device)
        model = build_target(args, weights, dtype, device, fused_kernels=cfg.model.fused_kernels)
        max_len = max_model_len(cfg, args)
        num_blocks = num_blocks_for(cfg, max_len)
        cache = model.allocate_cache(num_blocks, cfg.scheduler.block_size, device)
        if head is None:
            head = load_head(cfg, args)
        draft = build_draft(cfg, head, model, num_blocks, device, dtype) if cfg.speculative.enabled else None
        k = cfg.speculative.num_draft_tokens if draft is not None else 0
        target = build_runner(cfg, model, cache, device, k, max_len)
        if isinstance(draft, MTPEagleChain) and device.startswith("cuda") and cfg.model.cuda_graphs:
            target.fused = build_fused(cfg, target, draft, k, max_len)
        sched = Scheduler(cfg.scheduler, num_blocks, k, args.eos_ids(), max_len)
        return cls(cfg, args, sched, target, draft, tokenizer)

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | dict[str, Any]) -> SamplingParams:
        """Check a request; raises InvalidRequestError naming the field and the reason."""
        if not isinstance(params, SamplingParams):
            try:
                params = SamplingParams.model_validate(params)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise InvalidRequestError(".".join(str(p) for p in err["loc"]), err["msg"]) from None
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
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError("stop_token_ids", f"token id {t} is outside [0, {vocab})")
        total = min(n + params.max_tokens, self.max_model_len)
        sched = self.scheduler
        if sched.blocks.blocks_for(sched.slots_needed(total)) > sched.blocks.num_blocks:
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
        self.scheduler.add(Request(rid, list(prompt_token_ids), params))
        return rid

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
        in process, unless `model.overlap_speculative` is off), the next step is queued
        on the device before this one's tokens are read, its
        inputs taken from this step's results on the device, so host work overlaps GPU work. A request
        that stops at this step then computes one extra step, which is dropped."""
        runner = self._overlap_runner
        if self._launched is None:
            plan = self.scheduler.schedule()
            self._launched = runner.launch(plan) if runner is not None else None
            if self._launched is None:
                return self._execute(plan)
        assert runner is not None
        current = self._launched
        ahead = self.scheduler.plan_ahead(current.plan)
        self._launched = runner.launch(ahead, current) if ahead is not None else None
        if ahead is not None and self._launched is None:
            self.scheduler.cancel_ahead(ahead)
        out = runner.collect(current)
        outputs = self._apply(current.plan, out, out.draft_outputs)
        if self._launched is not None and not self.has_unfinished():
            self.drain()  # every request in the step queued ahead has finished: wait for it now, not later
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read and apply a step queued ahead by `step`, if any, so that the scheduler's state is current
        (for callers that drive the scheduler and target directly)."""
        launched, self._launched = self._launched, None
        if launched is None or self._overlap_runner is None:
            return []
        out = self._overlap_runner.collect(launched)
        return self._apply(launched.plan, out, out.draft_outputs)

    def _execute(self, plan: StepPlan) -> list[RequestOutput]:
        out = self.target.execute(plan)
        drafts = out.draft_outputs or (
            self.draft.propose(out.draft_inputs) if self.draft and out.draft_inputs else None
        )
        return self._apply(plan, out, drafts)

    def _apply(self, plan: StepPlan, out: TargetOutput, drafts: DraftOutputs | None) -> list[RequestOutput]:
        outputs = self.scheduler.update(plan, out, drafts)
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
        while self.has_unfinished():
            for o in self.step():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    done[o.request_id] = Completion(
                        o.request_id,
                        prompts_by_id[o.request_id],
                        tokens[o.request_id],
                        o.finish_reason,
                        o.stats,
                    )
        for c in done.values():
            c.text = self.decode(c.token_ids)
        return [done[rid] for rid in ids]

    def shutdown(self) -> None:
        """Release executors (actors, process groups); the in-process engine has nothing to release."""
        for part in (self.target, self.draft):
            close = getattr(part, "shutdown", None)
            if close is not None:
                close()

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


def encode_text(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids for `text` with `tokenizer`, as a user turn of its chat template when chat is True."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_target(
    args: LlamaArgs,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    tp: Any = None,
    fused_kernels: bool = True,
) -> LlamaModel:
    """Construct the (sharded) target model, load weights and prepare it for inference."""
    model = LlamaModel(args, tp)
    model.load_hf_state_dict(weights)
    model = model.to(device=device, dtype=dtype).eval()
    return model.prepare_for_inference(pick_ops(device, fused_kernels))


def graph_max_blocks(cfg: MTPServeConfig, k: int, max_len: int) -> int:
    """Blocks per request the captured steps' block tables hold: a full-length request plus draft slots."""
    return -(-(max_len + 2 * k) // cfg.scheduler.block_size)


def build_runner(
    cfg: MTPServeConfig, model: LlamaModel, cache: KVCache, device: str, k: int, max_len: int
) -> TargetRunner:
    """The target runner, with captured generation steps (Q = K+1 rows per request) on CUDA."""
    uniform = None
    if device.startswith("cuda") and cfg.model.cuda_graphs:
        max_blocks = graph_max_blocks(cfg, k, max_len)
        uniform = UniformTargetStep(model, cache, k + 1, cfg.scheduler.max_num_requests, max_blocks, device)
        uniform.steps.capture()
    return TargetRunner(model, cache, device, cfg.speculative.lookahead_source, uniform)


def build_fused(cfg: MTPServeConfig, target: TargetRunner, chain: MTPEagleChain, k: int, max_len: int) -> FusedSpecStep:
    """Generation steps with the colocated draft (greedy and sampling), captured per batch bucket."""
    max_blocks = graph_max_blocks(cfg, k, max_len)
    fused = FusedSpecStep(
        target.model, target.cache, chain, k, cfg.scheduler.max_num_requests, max_blocks, target.device
    )
    fused.steps.capture()
    return fused


def build_chain_graphs(cfg: MTPServeConfig, draft: DraftMethod | None, max_len: int) -> None:
    """Capture the chain's generation-only steps on CUDA, for a draft that runs apart from the target's
    fused step (a separate draft worker, or rank 0 of a Ray target group)."""
    k = cfg.speculative.num_draft_tokens
    if isinstance(draft, MTPEagleChain) and draft.device.type == "cuda" and cfg.model.cuda_graphs:
        max_blocks = graph_max_blocks(cfg, k, max_len)
        draft.uniform = UniformChainStep(draft, k, cfg.scheduler.max_num_requests, max_blocks)
        draft.uniform.capture()


def load_head(cfg: MTPServeConfig, args: LlamaArgs) -> MTPEagleHead | None:
    """The configured draft head: shipped default, explicit path, explicit random, or None."""
    spec = cfg.speculative
    if not spec.enabled or spec.draft is None:
        return None
    if spec.draft == "random":
        log.warning("using an untrained random MTP head (explicitly requested): acceptance will be near zero")
        head = MTPEagleHead(args)
        head.init_random(seed=cfg.model.seed)
        return head
    if spec.draft == "default":
        if cfg.model.path is not None or not DEFAULT_HEAD.is_file():
            log.warning("no default draft head for this model; speculation is off (pass --draft PATH)")
            return None
        path = DEFAULT_HEAD
    else:
        path = Path(spec.draft)
    if not path.is_file():
        raise ModelLoadError(f"speculative.draft '{spec.draft}' is not a file; train one with `mtpserve train-draft`")
    try:
        return MTPEagleHead.load(path, args)
    except Exception as exc:
        raise ModelLoadError(f"draft head {path} does not fit this target: {exc}") from exc


def build_draft(
    cfg: MTPServeConfig,
    head: MTPEagleHead | None,
    shared: LlamaModel,
    num_blocks: int,
    device: str,
    dtype: torch.dtype,
) -> DraftMethod | None:
    """The MTP Eagle chain around `head`, sharing `shared`'s embedding and output head, or None."""
    if head is None:
        return None
    head = head.to(device=device, dtype=dtype).eval()
    prepare_for_inference(head, pick_ops(device, cfg.model.fused_kernels))
    cache = head.allocate_cache(num_blocks, cfg.scheduler.block_size, device)
    lookahead = LookaheadBuffer(cfg.scheduler.max_num_requests, device)
    return MTPEagleChain(head, shared, cache, lookahead, device, cfg.scheduler.max_num_batched_tokens)
