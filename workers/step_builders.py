"""The captured steps of a target runner (`captured_steps`) and the runner built over them (`build_runner`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.methods import DraftMethod
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.speculative.verify import ForcedAcceptance
from mtpserve.workers.captured_steps import CapturedSteps
from mtpserve.workers.chain_step import UniformChainStep
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.fused_step import FusedDepthSteps, FusedSpecStep
from mtpserve.workers.prefill_step import PREFILL_ROWS, CapturedPrefill
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.tree_step import FusedTreeStep
from mtpserve.workers.uniform_step import UniformTargetStep


@dataclass(frozen=True)
class TargetParts:
    """What a target's steps run over: its model, KV cache and device; `replay` (benchmarks only) makes greedy
    verify steps accept recorded drafts (`speculative/replay.py`)."""

    model: LlamaModel
    cache: KVCache
    device: torch.device
    replay: ForcedAcceptance | None = None


def graph_max_blocks(cfg: MTPServeConfig, k: int, max_len: int) -> int:
    """Blocks per request the captured steps' block tables hold: a full-length request plus draft slots."""
    spec = cfg.speculative
    extra = 2 * k if not spec.tree_budget else spec.proposed_tokens + 1 + spec.scratch_slots
    return -(-(max_len + extra) // cfg.scheduler.block_size)


def build_target_step(cfg: MTPServeConfig, parts: TargetParts, k: int, max_len: int) -> UniformTargetStep:
    """The target's own generation step (Q = K+1 rows per request; Q = 1 with draft trees, which are verified
    eagerly or by the tree step), captured per batch bucket."""
    if cfg.speculative.tree_budget:
        k = 0
    step = UniformTargetStep(
        parts.model,
        parts.cache,
        k + 1,
        max_batch=cfg.scheduler.max_num_requests,
        max_blocks=graph_max_blocks(cfg, k, max_len),
        device=parts.device,
        replay=parts.replay,
    )
    step.steps.capture()
    return step


def build_fused(cfg: MTPServeConfig, parts: TargetParts, chain: MTPEagleChain, k: int, max_len: int) -> FusedSpecStep:
    """Generation steps with the colocated draft (greedy and sampling), captured per batch bucket."""
    fused = FusedSpecStep(
        parts.model,
        parts.cache,
        chain,
        k,
        max_batch=cfg.scheduler.max_num_requests,
        max_blocks=graph_max_blocks(cfg, k, max_len),
        device=parts.device,
        replay=parts.replay,
    )
    fused.steps.capture()
    fused.warm_up()
    return fused


def build_fused_depths(
    cfg: MTPServeConfig, parts: TargetParts, chain: MTPEagleChain, k: int, max_len: int
) -> FusedDepthSteps:
    """Fused steps for every draft depth 0..K (adaptive speculation), each captured per batch bucket."""
    return FusedDepthSteps({d: build_fused(cfg, parts, chain, d, max_len=max_len) for d in range(k + 1)})


def build_prefill(
    cfg: MTPServeConfig, parts: TargetParts, draft: DraftMethod | None, k: int, max_len: int
) -> CapturedPrefill | None:
    """A step's prompt chunks, target and colocated chain together, captured per row bucket; None where it does
    not apply (config, a latent-attention model, `sampled` lookahead, another draft method)."""
    chain = draft if isinstance(draft, MTPEagleChain) else None
    if isinstance(draft, MTPEagleTree) and draft.chains:
        chain = draft.chain  # adaptive: chain steps' prompt chunks (a tree step's chunks run eagerly)
    if not cfg.model.prefill_graphs or not parts.model.ragged_capture or (draft is not None and chain is None):
        return None
    if cfg.speculative.lookahead_source != "prompt":
        return None
    sc = cfg.scheduler
    step = CapturedPrefill(
        parts.model,
        parts.cache,
        chain,
        k,
        max_tokens=min(max(sc.chunk_size, PREFILL_ROWS), sc.max_num_batched_tokens),
        max_blocks=graph_max_blocks(cfg, k, max_len),
        device=parts.device,
    )
    step.capture()
    return step


def build_tree_step(cfg: MTPServeConfig, parts: TargetParts, drafter: MTPEagleTree, max_len: int) -> FusedTreeStep:
    """Tree steps with the colocated drafter, captured per batch bucket and sampling mode."""
    step = FusedTreeStep(
        parts.model,
        parts.cache,
        drafter,
        max_batch=cfg.scheduler.max_num_requests,
        max_blocks=graph_max_blocks(cfg, drafter.depth, max_len),
        device=parts.device,
        replay=parts.replay,
    )
    step.steps.try_capture()
    step.warm_up()
    return step


def captured_steps(
    cfg: MTPServeConfig, parts: TargetParts, draft: DraftMethod | None, k: int, max_len: int, *, local: bool = True
) -> CapturedSteps:
    """Every captured step of a target on CUDA with graphs (none elsewhere): its own generation step and, with
    `local` (this process holds the whole target: in process, or a TP=1 Ray rank), the steps that fold the
    draft in: fused chain steps (one per depth when adaptive) for a chain, the tree step for trees (both when
    adaptive over trees), and the prefill step. With model.fused_steps off, the draft's chain is captured
    apart instead."""
    if not (parts.device.type == "cuda" and cfg.model.cuda_graphs):
        return CapturedSteps()
    target = build_target_step(cfg, parts, k, max_len)
    if not local:
        return CapturedSteps(target=target)
    chain: FusedSpecStep | FusedDepthSteps | None = None
    tree = None
    if not cfg.model.fused_steps:
        build_chain_graphs(cfg, draft, max_len)
    elif isinstance(draft, MTPEagleChain):
        chain = (build_fused_depths if cfg.speculative.adaptive else build_fused)(cfg, parts, draft, k, max_len=max_len)
    elif isinstance(draft, MTPEagleTree):
        if draft.chains:
            chain = build_fused_depths(cfg, parts, draft.chain, k, max_len=max_len)
        tree = build_tree_step(cfg, parts, draft, max_len)
    return CapturedSteps(target, chain, tree, build_prefill(cfg, parts, draft, k, max_len=max_len))


def build_runner(
    cfg: MTPServeConfig,
    parts: TargetParts,
    draft: DraftMethod | None,
    k: int,
    max_len: int,
    *,
    local: bool = True,
    drafting: bool | None = None,
) -> TargetRunner:
    """The target runner over its captured steps (`captured_steps`, which fold `draft` in where they can);
    drafting (a draft follows it) when `draft` is given unless `drafting` says otherwise."""
    steps = captured_steps(cfg, parts, draft, k, max_len=max_len, local=local)
    return TargetRunner(
        parts.model,
        parts.cache,
        parts.device,
        steps=steps,
        drafting=draft is not None if drafting is None else drafting,
        lookahead_source=cfg.speculative.lookahead_source,
        replay=parts.replay,
    )


def build_chain_graphs(cfg: MTPServeConfig, draft: DraftMethod | None, max_len: int) -> None:
    """Capture the chain's generation-only steps on CUDA, for a draft that runs apart from the target's
    fused step (a separate draft worker, or rank 0 of a Ray target group)."""
    k = cfg.speculative.num_draft_tokens
    if isinstance(draft, MTPEagleTree) and draft.chains:
        draft = draft.chain  # adaptive: its chains of depth K are captured (other depths and trees run eagerly)
    if isinstance(draft, MTPEagleChain) and draft.device.type == "cuda" and cfg.model.cuda_graphs:
        max_blocks = graph_max_blocks(cfg, k, max_len)
        draft.uniform = UniformChainStep(draft, k, cfg.scheduler.max_num_requests, max_blocks)
        draft.uniform.capture()
