"""Model families by config: which hyper-parameters, model class and random weights a checkpoint uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mtpserve.modeling.deepseek import DeepseekV3Model
from mtpserve.modeling.deepseek_config import MODEL_TYPES as DEEPSEEK_TYPES
from mtpserve.modeling.deepseek_config import DeepseekV3Args
from mtpserve.modeling.deepseek_weights import init_dummy_, random_deepseek_weights
from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.fp32_modules import KeptInFp32
from mtpserve.modeling.model import LlamaArgs, LlamaModel, random_llama_weights
from mtpserve.modeling.qwen import MODEL_TYPES as QWEN_TYPES
from mtpserve.modeling.qwen import QwenArgs, QwenModel, is_qwen_style, random_qwen_weights

LLAMA_TYPES = frozenset({"llama", "mistral"})


class InPlaceDummy(dict[str, torch.Tensor]):
    """The (empty) weights of a dummy load whose family makes random weights in place on the device: a
    marker, so that an empty checkpoint is never mistaken for a dummy load."""


class RandomWeights(Protocol):
    """Full HF-named random weights for a config."""

    def __call__(self, args: Any, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
        """Weights for `args`."""
        ...


@dataclass(frozen=True)
class Family:
    """One architecture: its hyper-parameters, model class and random-weight generator."""

    name: str
    args_type: type[LlamaArgs]
    model_type: type[LlamaModel]
    random_weights: RandomWeights

    host_dummy_weights: bool = True  # dummy loads make host tensors; False: built in place on the device


LLAMA = Family("llama", LlamaArgs, LlamaModel, random_llama_weights)
DEEPSEEK_V3 = Family("deepseek_v3", DeepseekV3Args, DeepseekV3Model, random_deepseek_weights, host_dummy_weights=False)
QWEN = Family("qwen", QwenArgs, QwenModel, random_qwen_weights)


def family_of_config(cfg: dict[str, Any], where: str = "config.json") -> Family:
    """The family of an HF config.json dict; ModelLoadError naming the model_type otherwise."""
    model_type = cfg.get("model_type", "llama")
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if model_type in DEEPSEEK_TYPES:
        return DEEPSEEK_V3
    if model_type in QWEN_TYPES:
        return QWEN
    if model_type in LLAMA_TYPES or "Llama" in archs[0]:
        return QWEN if is_qwen_style(cfg) else LLAMA
    known = sorted(LLAMA_TYPES | DEEPSEEK_TYPES | QWEN_TYPES)
    raise ModelLoadError(f"{where}: model_type '{model_type}' is not supported (known: {', '.join(known)})")


def family_of(args: LlamaArgs) -> Family:
    """The family whose hyper-parameter class `args` is (the most derived one)."""
    if isinstance(args, DeepseekV3Args):
        return DEEPSEEK_V3
    return QWEN if isinstance(args, QwenArgs) else LLAMA


def args_from_config(cfg: dict[str, Any], where: str = "config.json") -> LlamaArgs:
    """Hyper-parameters of an HF config.json dict, of its family's class."""
    fam = family_of_config(cfg, where)
    try:
        return fam.args_type.from_hf_dict(cfg)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def model_class(args: LlamaArgs) -> type[LlamaModel]:
    """The model class serving `args`."""
    return family_of(args).model_type


@torch.no_grad()
def allocate_on_device(module: nn.Module, device: str | torch.device, dtype: torch.dtype) -> None:
    """Give a module laid out on the meta device storage on `device` in `dtype` (`KeptInFp32` modules
    in fp32): parameters hold NaN until loaded, buffers zero, the RoPE table is rebuilt (the module needs
    `args` and `rotary`, as models and draft heads have)."""
    module.to(dtype)
    for m in module.modules():
        if isinstance(m, KeptInFp32):
            m.float()
    # to_empty's empty_like on meta tensors loads torch's symbolic-shape machinery (about 1 s of CPU)
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if isinstance(module, LlamaModel):
        module.tie_weights()
    for p in module.parameters():
        p.fill_(float("nan"))
    for b in module.buffers():
        b.zero_()
    _rebuild_rotary(module, device)


def approx_parameters(args: LlamaArgs) -> int:
    """About how many parameters a dense Llama-shaped model of `args` holds (embeddings, attention, MLP)."""
    d, hd = args.hidden_size, args.dim_per_head
    attn = d * hd * (2 * args.num_attention_heads + 2 * args.num_key_value_heads)
    layer = attn + 3 * d * args.intermediate_size
    embed = args.vocab_size * d * (1 if args.tie_word_embeddings else 2)
    return embed + args.num_hidden_layers * layer


def unloaded_parameters(module: nn.Module) -> list[str]:
    """Parameters that still hold NaN after loading (absent from the checkpoint, or NaN in it)."""
    return [name for name, p in module.named_parameters() if p.is_floating_point() and bool(torch.isnan(p).any())]


@torch.no_grad()
def materialize_dummy(module: nn.Module, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Give a module laid out on the meta device storage on `device` with random weights, in place."""
    allocate_on_device(module, device, dtype)
    init_dummy_(module, seed)
    _rebuild_rotary(module, device)


def _rebuild_rotary(module: nn.Module, device: str | torch.device) -> None:
    args: LlamaArgs = module.args  # type: ignore[assignment]
    module.rotary = model_class(args).rotary_for(args).to(device)
