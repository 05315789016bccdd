"""Builders of the in-process target and draft: model, KV cache, runner, captured steps, MTP chain.

The in-process engine (cluster/engine/llm_engine.py) and the Ray worker actors (target_worker.py, draft_worker.py)
build their parts with these functions from one MTPServeConfig.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.families import (
    InPlaceDummy,
    allocate_on_device,
    materialize_dummy,
    model_class,
    unloaded_parameters,
)
from mtpserve.modeling.fp32_modules import cast_keeping_fp32
from mtpserve.modeling.gemv_tiles import resolve as resolve_tiles
from mtpserve.modeling.kernel_choices import KernelChoices
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.layer_ops import pick_ops
from mtpserve.modeling.loader import ModelSource, resolve_device, resolve_model
from mtpserve.modeling.model import LlamaArgs, LlamaModel, prepare_for_inference
from mtpserve.speculative.adaptive import AcceptanceTracker, AdaptiveDepth, StepCosts, StepKind
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.eagle3_config import default_feature_layers as eagle3_layers
from mtpserve.speculative.eagle3_config import is_eagle3_dir
from mtpserve.speculative.eagle3_head import Eagle3Head
from mtpserve.speculative.lookahead import LookaheadBuffer
from mtpserve.speculative.methods import DraftMethod
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.mtp_native import native_heads, num_native_modules
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.speculative.mtp_vanilla import VanillaMTPChain
from mtpserve.workers.config import MTPServeConfig, cpu_threads
from mtpserve.workers.fused_step import FusedDepthSteps
from mtpserve.workers.graph_runner import capture_sizes
from mtpserve.workers.tree_step import FusedTreeStep

log = logging.getLogger(__name__)
DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "speculative" / "heads" / "smollm2-135m-mtp.safetensors"


def set_cpu_threads(cfg: MTPServeConfig) -> int | None:
    """For a process about to run the model on the CPU, set torch's threads (model.cpu_threads); returns them, or
    None when the model runs on a GPU. Called by the processes' entry points, never by a build."""
    if resolve_device(cfg.model.device) != "cpu":
        return None
    torch.set_num_threads(cpu_threads(cfg.model))
    return torch.get_num_threads()


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
    spec = cfg.speculative
    full = -(-(max_model_len + spec.proposed_tokens + spec.scratch_slots) // sc.block_size)
    return max(sc.max_num_requests * per_request, full) + 1


def build_target(
    args: LlamaArgs,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    *,
    tp: Any = None,
    fused_kernels: bool = True,
    pdl_launch: bool = True,
    gemv_tiles: str = "auto",
) -> LlamaModel:
    """Construct the (sharded) target model on `device` in `dtype`, load its weights straight into it (no
    fp32 copy on the host) and prepare it for inference; for an in-place dummy load, random weights are made
    on the device. `pdl_launch` sets whether the model's small-step kernels launch with PDL
    (`modeling/pdl.py`), `gemv_tiles` their matrix-vector tiles (`modeling/gemv_tiles.py`): the model's
    `kernel_choices`, in force while it runs."""
    on_cuda = torch.device(device).type == "cuda"
    tiles = resolve_tiles(gemv_tiles, torch.cuda.get_device_name(device) if on_cuda else None)
    with torch.device("meta"):
        model = model_class(args)(args, tp)
    model.kernel_choices = KernelChoices(pdl=pdl_launch, gemv_tiles=tiles)
    if isinstance(weights, InPlaceDummy):
        materialize_dummy(model, device, dtype)
    else:
        allocate_on_device(model, device, dtype)
        model.load_hf_state_dict(weights)
        missing = unloaded_parameters(model)
        if missing:
            raise ModelLoadError(f"after loading, {len(missing)} parameter(s) hold NaN, e.g. {missing[:3]}")
    return model.eval().prepare_for_inference(pick_ops(device, fused_kernels))


def build_configured_target(
    cfg: MTPServeConfig,
    args: LlamaArgs,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    tp: Any = None,
) -> LlamaModel:
    """`build_target` with the kernel choices of the model config (fused kernels, PDL, GEMV tiles)."""
    m = cfg.model
    return build_target(
        args, weights, dtype, device, tp=tp, fused_kernels=m.fused_kernels, pdl_launch=m.pdl, gemv_tiles=m.gemv_tiles
    )


def build_shared(
    cfg: MTPServeConfig, args: LlamaArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> LlamaModel:
    """The target's embedding, final norm and lm_head without its layers, for a draft on another worker."""
    return build_configured_target(cfg, replace(args, num_hidden_layers=0), weights, dtype, device=device)


def tree_kind(drafter: MTPEagleTree) -> StepKind:
    """The step kind of a tree drafter's trees (its width capped by the draft vocabulary, as it grows them)."""
    return StepKind.tree(min(drafter.depth, drafter.budget), drafter.budget, drafter.width)


def config_tree_kind(cfg: MTPServeConfig) -> StepKind | None:
    """The tree a configuration drafts (alone, or besides its chains when adaptive), from the settings alone
    (for a scheduler whose drafter runs elsewhere); None without one."""
    spec = cfg.speculative
    if not spec.tree_budget:
        return None
    return StepKind.tree(min(spec.num_draft_tokens, spec.tree_budget), spec.tree_budget, spec.tree_width)


def depth_policy(
    cfg: MTPServeConfig,
    k: int,
    fused: Any = None,
    timed: dict[tuple[int, int], float] | None = None,
    tree: StepKind | None = None,
    tree_step: FusedTreeStep | None = None,
) -> AdaptiveDepth:
    """The adaptive policy over chain depths 0..k and the draft tree `tree` (if any): step costs per (batch
    bucket, kind) timed once on the fused depth steps and the tree step when there are some (`fused` and
    `tree_step`, or their times from another process in `timed`, keyed by (bucket, draft count): a depth,
    or the tree's budget), else observed from the engine's own steps. Tree steps are launched ahead like chain
    steps, so their timed replays stand for them as the chains' do."""
    if isinstance(fused, FusedDepthSteps):
        timed = fused.time_steps()
        if tree is not None and tree_step is not None:
            timed.update({(bucket, tree.budget): s for bucket, s in tree_step.time_steps().items()})
    if timed is not None and tree is not None and all(n != tree.budget for _, n in timed):
        tree = None  # timed chains against an untimed tree: leave the tree out
    trees = [tree] if tree is not None else []
    buckets = capture_sizes(cfg.scheduler.max_num_requests)
    costs = StepCosts(buckets, k, online=timed is None, trees=trees)
    policy = AdaptiveDepth(costs, AcceptanceTracker(k))
    for (bucket, count), seconds in (timed or {}).items():
        costs.set(bucket, policy.kind_of(count), seconds)
    return policy


DEFAULT_HEAD_TARGET = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}  # SmolLM2-135M's shape


def default_head_fits(args: LlamaArgs) -> bool:
    """Whether a target has the shape the shipped head was trained for (SmolLM2-135M, wherever it is read from)."""
    shape = asdict(args)
    return all(shape[k] == v for k, v in DEFAULT_HEAD_TARGET.items())


def draft_source(cfg: MTPServeConfig, args: LlamaArgs) -> str | None:
    """Where the draft comes from: 'random', 'native' (the checkpoint's MTP modules), a head file, or None
    (no speculation), without loading anything."""
    spec = cfg.speculative
    if not spec.enabled or spec.draft is None:
        return None
    source = spec.draft
    if spec.method == "eagle3" and source in ("default", "native"):
        raise ModelLoadError(
            f"speculative.draft: speculative.method 'eagle3' needs an EAGLE-3 checkpoint directory (or 'random'), "
            f"not '{source}'"
        )
    if source == "default":
        if num_native_modules(args):
            source = "native"
        elif not DEFAULT_HEAD.is_file() or (cfg.model.path is not None and not default_head_fits(args)):
            log.warning("no default draft head for this model; speculation is off (pass --draft PATH)")
            return None
        else:
            source = str(DEFAULT_HEAD)
    if DRAFT_METHODS[spec.method].needs_native and source != "native":
        raise ModelLoadError(
            f"speculative.method '{spec.method}' needs the checkpoint's own MTP modules (speculative.draft "
            f"'native'); the draft resolves to '{source}'"
        )
    return source


def load_heads(
    cfg: MTPServeConfig, args: LlamaArgs, weights: dict[str, torch.Tensor] | None = None
) -> list[DraftHead] | None:
    """The configured draft modules (one for MTP Eagle and EAGLE-3, K for vanilla MTP), or None. Native modules
    are read from the target's `weights`."""
    source = draft_source(cfg, args)
    if source is None:
        return None
    spec = cfg.speculative
    if source == "native":
        if weights is None:
            raise ModelLoadError("native MTP modules are read from the target checkpoint; its weights are needed")
        return list(native_heads(args, weights, DRAFT_METHODS[spec.method].modules(spec.num_draft_tokens)))
    method = DRAFT_METHODS[spec.method]
    if source == "random":
        log.warning("using an untrained random draft head (explicitly requested): acceptance will be near zero")
        if spec.draft_vocab > args.vocab_size:
            raise ModelLoadError(
                f"speculative.draft_vocab: {spec.draft_vocab} exceeds the target's vocabulary of {args.vocab_size}"
            )
        head = method.random(args, torch.arange(spec.draft_vocab) if spec.draft_vocab else None)
        head.init_random(seed=cfg.model.seed)
        return [head]
    path = Path(source)
    if spec.method == "eagle3" and not is_eagle3_dir(path):
        raise ModelLoadError(
            f"speculative.draft '{spec.draft}' is not an EAGLE-3 checkpoint directory (config.json naming "
            "LlamaForCausalLMEagle3 or Eagle3Speculator, and its weights)"
        )
    if spec.method != "eagle3" and not path.is_file():
        hint = " (an EAGLE-3 checkpoint: pass --spec-method eagle3)" if is_eagle3_dir(path) else ""
        raise ModelLoadError(
            f"speculative.draft '{spec.draft}' is not a file{hint}; train one with `mtpserve train-draft`"
        )
    try:
        return [method.load(path, args)]
    except Exception as exc:
        raise ModelLoadError(f"draft head {path} does not fit this target: {exc}") from exc


def bind_features(model: LlamaModel, heads: list[DraftHead] | None) -> None:
    """Make the target return the features the first draft module reads."""
    if heads:
        model.feature_layers = heads[0].feature_layers
        model.normed_features = heads[0].normed_input


def _prepared(cfg: MTPServeConfig, head: DraftHead, device: str, dtype: torch.dtype) -> DraftHead:
    if any(p.is_meta for p in head.parameters()):  # a dummy native module
        materialize_dummy(head, device, dtype, seed=cfg.model.seed + 1)
    else:
        cast_keeping_fp32(head, device, dtype)
    head.eval()
    prepare_for_inference(head, pick_ops(device, cfg.model.fused_kernels))
    return head


def build_draft(
    cfg: MTPServeConfig,
    heads: list[DraftHead] | None,
    shared: LlamaModel,
    num_blocks: int,
    device: str,
    dtype: torch.dtype,
) -> DraftMethod | None:
    """The configured draft method around `heads`, sharing `shared`'s embedding and output head, or None."""
    if not heads:
        return None
    heads = [_prepared(cfg, h, device, dtype) for h in heads]
    caches = [h.allocate_cache(num_blocks, cfg.scheduler.block_size, device) for h in heads]
    lookahead = LookaheadBuffer(cfg.scheduler.max_num_requests, device)
    method = DRAFT_METHODS[cfg.speculative.method].build(cfg, heads, shared, caches, look=lookahead, dev=device)
    spec = cfg.speculative
    if spec.tree_budget and isinstance(method, MTPEagleChain):
        return MTPEagleTree(method, spec.num_draft_tokens, spec.tree_width, spec.tree_budget, chains=spec.adaptive)
    return method


class DraftBuilder(Protocol):
    """Builds a method's draft around its heads (a protocol, not a Callable, so it is called with keywords)."""

    def __call__(
        self,
        cfg: MTPServeConfig,
        heads: list[DraftHead],
        shared: LlamaModel,
        caches: list[KVCache],
        look: LookaheadBuffer,
        dev: str,
    ) -> DraftMethod: ...


@dataclass(frozen=True)
class DraftMethodSpec:
    """How a `speculative.method` is built: its chain, how many draft modules it runs for K draft tokens,
    whether they must be the checkpoint's own MTP modules, how its head is read from `speculative.draft`
    and how an untrained one is shaped (`speculative.draft: random`)."""

    build: DraftBuilder
    modules: Callable[[int], int]
    needs_native: bool = False
    load: Callable[[Path, LlamaArgs], DraftHead] = MTPEagleHead.load
    random: Callable[[LlamaArgs, torch.Tensor | None], DraftHead] = lambda args, vocab: MTPEagleHead(
        args, vocab_ids=vocab
    )


def _eagle(
    cfg: MTPServeConfig,
    heads: list[DraftHead],
    shared: LlamaModel,
    caches: list[KVCache],
    look: LookaheadBuffer,
    dev: str,
) -> DraftMethod:
    return MTPEagleChain(heads[0], shared, caches[0], look, device=dev, max_rows=cfg.scheduler.max_num_batched_tokens)


DRAFT_METHODS: dict[str, DraftMethodSpec] = {
    "mtp_eagle": DraftMethodSpec(_eagle, modules=lambda k: 1),
    "eagle3": DraftMethodSpec(
        _eagle,
        modules=lambda k: 1,
        load=Eagle3Head.load,
        random=lambda args, vocab: Eagle3Head(args, eagle3_layers(args.num_hidden_layers), vocab_ids=vocab),
    ),
    "mtp_vanilla": DraftMethodSpec(
        lambda cfg, heads, shared, caches, look, dev: (
            VanillaMTPChain([cast(MTPEagleHead, h) for h in heads], shared, caches, look, device=dev)
            if len(heads) > 1
            else _eagle(cfg, heads, shared, caches, look=look, dev=dev)  # one module: the same chain, captured on CUDA
        ),
        modules=lambda k: k,
        needs_native=True,
    ),
}
