"""The EAGLE-3 checkpoint format: what a draft directory's config.json and tensor names say, checked against
the target it is served with.

A directory holds config.json and the weights (`*.safetensors`, or `pytorch_model.bin`). Two config layouts
are read:
- `LlamaForCausalLMEagle3` (SpecForge, SGLang, the EAGLE authors): a Llama config of the draft's one decoder
  layer at the top level, plus `draft_vocab_size`, optionally `target_hidden_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids` (0-based target layers whose outputs are fused);
- `Eagle3Speculator` (vLLM speculators): the layer's Llama config under `transformer_layer_config`, with
  `draft_vocab_size`, `norm_before_residual`, `target_hidden_size` and `eagle_aux_hidden_state_layer_ids`
  at the top level. vLLM reads the latter as "the input of layer j", the output of layer j - 1.
Without either list the common default applies: the outputs of layers 1, L/2 - 1 and L - 4 of an L-layer
target (vLLM and SGLang: inputs of layers 2, L/2 and L - 3).

Tensor names, with an optional `model.` prefix and `layers.0.` for `midlayer.`:
- fc.weight [d, n*d]                         fuses the n feature layers' outputs
- midlayer.input_layernorm.weight [d]        RMSNorm of the token embedding
- midlayer.hidden_norm.weight [d]            RMSNorm of the fused hidden state
- midlayer.self_attn.{q,k,v}_proj.weight     [heads*head_dim, 2d]: over concat(normed embedding, normed hidden)
- midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj
- norm.weight [d], lm_head.weight [V', d]    the draft's output norm and head over its V' tokens
- d2t [V'] int64                             target id of draft row r is r + d2t[r]
- t2d [V] bool                               which target ids the draft vocabulary holds
- embed_tokens.weight [V, d]                 optional; without it the target's embedding is used
The residual around the attention is the fused hidden state itself (`norm_before_residual`: its normed form).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtpserve.modeling.model import LlamaArgs

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3Speculator", "Eagle3LlamaForCausalLM")
NESTED_LAYERS = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_LAYERS = "eagle_aux_hidden_state_layer_ids"
OPTIONAL = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")


class Eagle3FormatError(ValueError):
    """An EAGLE-3 checkpoint that cannot be served with this target; names the field or tensor."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass
class Eagle3Spec:
    """An EAGLE-3 draft's shape, as its config describes it."""

    layer: LlamaArgs  # the draft decoder layer (hidden size, heads, MLP, RoPE)
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # target layers whose outputs are fused, 0-based
    norm_before_residual: bool = False


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The common EAGLE-3 choice for an L-layer target: outputs of layers 1, L/2 - 1 and L - 4."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of an EAGLE-3 draft directory; Eagle3FormatError when it is not one."""
    path = directory / "config.json"
    if not path.is_file():
        raise Eagle3FormatError("config.json", f"{directory} has none; an EAGLE-3 draft is a directory with one")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise Eagle3FormatError("architectures", f"{archs} is not an EAGLE-3 draft ({', '.join(ARCHITECTURES)})")
    return cfg


def is_eagle3_dir(path: str | Path) -> bool:
    """Whether `path` is a directory whose config.json names an EAGLE-3 draft architecture."""
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        archs = json.loads(p.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a in ARCHITECTURES for a in archs)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weight files, under canonical names (`midlayer.`, no `model.`)."""
    files = sorted(directory.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
    elif (directory / "pytorch_model.bin").is_file():
        out = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise Eagle3FormatError("weights", f"{directory} has no *.safetensors or pytorch_model.bin")
    return {canonical_name(k): v for k, v in out.items()}


def canonical_name(name: str) -> str:
    """`model.layers.0.x` / `layers.0.x` / `midlayer.x` -> `midlayer.x`; other names lose a `model.` prefix."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def parse_spec(cfg: dict[str, Any], target: LlamaArgs) -> Eagle3Spec:
    """The draft's shape from its config, checked against the target; Eagle3FormatError naming the field."""
    layer_cfg = dict(cfg.get("transformer_layer_config") or cfg)
    layer_cfg.setdefault("num_hidden_layers", 1)
    if "num_attention_heads" in layer_cfg:
        layer_cfg.setdefault("num_key_value_heads", layer_cfg["num_attention_heads"])
    if layer_cfg["num_hidden_layers"] != 1:
        raise Eagle3FormatError("num_hidden_layers", f"{layer_cfg['num_hidden_layers']}; one decoder layer is served")
    for key in ("attention_bias", "mlp_bias"):
        if layer_cfg.get(key):
            raise Eagle3FormatError(key, "biases in the draft layer are not served")
    if layer_cfg.get("hidden_act", "silu") != "silu":
        raise Eagle3FormatError("hidden_act", f"'{layer_cfg['hidden_act']}'; only silu (SwiGLU) is served")
    try:
        layer = LlamaArgs.from_hf_dict(layer_cfg)
    except (TypeError, ValueError) as exc:
        raise Eagle3FormatError("config.json", f"not a servable Llama layer config ({exc})") from None
    d = target.hidden_size
    if layer.hidden_size != d:
        raise Eagle3FormatError("hidden_size", f"{layer.hidden_size}, but the target's hidden size is {d}")
    target_hidden = cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or d
    if target_hidden != d:
        raise Eagle3FormatError("target_hidden_size", f"{target_hidden}, but the target's hidden size is {d}")
    if layer.vocab_size != target.vocab_size:
        raise Eagle3FormatError("vocab_size", f"{layer.vocab_size}, but the target's vocabulary is {target.vocab_size}")
    draft_vocab = cfg.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or target.vocab_size
    if not 1 <= draft_vocab <= target.vocab_size:
        raise Eagle3FormatError("draft_vocab_size", f"{draft_vocab} is outside [1, {target.vocab_size}]")
    positions = max(layer.max_position_embeddings, target.max_position_embeddings)
    layer = dataclasses.replace(layer, max_position_embeddings=positions)
    nbr = bool(cfg.get("norm_before_residual", layer_cfg.get("norm_before_residual", False)))
    return Eagle3Spec(layer, int(draft_vocab), feature_layers(cfg, target.num_hidden_layers), nbr)


def feature_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the draft fuses, 0-based, from whichever list the config carries
    (see the module docstring), else the default; Eagle3FormatError naming the list when out of range."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get(TOP_LAYERS)
    if nested is not None and top is not None and [i + 1 for i in nested] != list(top):
        raise Eagle3FormatError(
            TOP_LAYERS, f"{list(top)} (inputs of layers) disagrees with {NESTED_LAYERS} {list(nested)} (outputs)"
        )
    if nested is not None:
        field, layers = NESTED_LAYERS, tuple(int(i) for i in nested)
    elif top is not None:
        field, layers = TOP_LAYERS, tuple(int(i) - 1 for i in top)
    else:
        field, layers = f"{NESTED_LAYERS} (absent: the default 1, L/2-1, L-4)", default_feature_layers(num_layers)
    check_feature_layers(layers, num_layers, field)
    return layers


def check_feature_layers(layers: tuple[int, ...], num_layers: int, field: str = NESTED_LAYERS) -> None:
    """Raise Eagle3FormatError unless `layers` are at least two distinct ascending layers of the target."""
    if len(layers) < 2 or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= num_layers:
        raise Eagle3FormatError(
            field,
            f"target layers {list(layers)} must be two or more distinct ascending layers in [0, {num_layers - 1}] "
            f"(the target has {num_layers})",
        )


def vocab_ids_of(tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> torch.Tensor | None:
    """Target ids of the draft vocabulary's rows from d2t (checked against t2d), or None for the whole
    vocabulary in order; Eagle3FormatError naming the tensor."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if draft_vocab != vocab:
            raise Eagle3FormatError("d2t", f"absent, but the draft vocabulary ({draft_vocab}) is not the target's")
        return None
    if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
        raise Eagle3FormatError("d2t", f"must be an integer tensor [{draft_vocab}] (draft_vocab_size)")
    ids = torch.arange(draft_vocab) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or torch.unique(ids).numel() != draft_vocab:
        raise Eagle3FormatError("d2t", f"maps draft rows to ids outside [0, {vocab}) or to one id twice")
    if t2d is not None:
        mask = t2d.bool()
        if mask.shape != (vocab,) or int(mask.sum()) != draft_vocab or not bool(mask[ids].all()):
            raise Eagle3FormatError("t2d", "does not mark exactly the target ids that d2t maps to")
    return None if draft_vocab == vocab and bool((d2t == 0).all()) else ids


def hf_config(
    target: LlamaArgs, layer: LlamaArgs, spec: Eagle3Spec, dtype: torch.dtype, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for a draft of this shape, read by SpecForge / SGLang (`eagle_config`) and vLLM (the
    top-level list, in its input-of-layer numbering) alike."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.dim_per_head,
        "num_hidden_layers": 1,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "rope_scaling": layer.rope_scaling,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(spec.feature_layers), "use_aux_hidden_state": True},
        TOP_LAYERS: [i + 1 for i in spec.feature_layers],
    }
    if spec.norm_before_residual:
        cfg["norm_before_residual"] = True
    ids = {"bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_id}
    cfg.update({key: value for key, value in ids.items() if value is not None})
    cfg.update(extra or {})
    return cfg
