"""Tiny EAGLE-3 draft checkpoints written the way the public trainers publish them (config keys and tensor
names as SpecForge's `LlamaForCausalLMEagle3` and vLLM speculators' `Eagle3Speculator` name them), without
this project's EAGLE-3 code, and a plain-torch reference forward written from the format description."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mtpserve.modeling.model import LlamaArgs

HEADS = 4  # the draft layer's query heads and KV heads (its own choice, independent of the target's)


def mimic_tensors(
    args: LlamaArgs, weights: dict[str, torch.Tensor], vocab_ids: torch.Tensor | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Draft tensors (SpecForge names) for a `mimic` target: each query attends mostly to its own row, whose
    value is the normed next-token embedding, scored by the target's final norm and lm_head rows; the fused
    features add a little. It drafts the first position well and later ones (which read its own output as the
    hidden state) badly, so verification both accepts and rejects."""
    g = torch.Generator().manual_seed(seed)
    d = args.hidden_size

    def noise(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    eye, zero = torch.eye(d), torch.zeros(d, d)
    lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    ids = torch.arange(args.vocab_size) if vocab_ids is None else vocab_ids
    t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    inter = 2 * d
    return {
        "fc.weight": noise(d, 3 * d, std=0.05),
        "midlayer.input_layernorm.weight": 1.0 + noise(d),
        "midlayer.hidden_norm.weight": 1.0 + noise(d),
        "midlayer.self_attn.q_proj.weight": torch.cat([math.sqrt(2.0) * eye, zero], 1) + noise(d, 2 * d),
        "midlayer.self_attn.k_proj.weight": torch.cat([math.sqrt(2.0) * eye, zero], 1) + noise(d, 2 * d),
        "midlayer.self_attn.v_proj.weight": torch.cat([eye, zero], 1) + noise(d, 2 * d),
        "midlayer.self_attn.o_proj.weight": eye + noise(d, d),
        "midlayer.post_attention_layernorm.weight": 1.0 + noise(d),
        "midlayer.mlp.gate_proj.weight": noise(inter, d),
        "midlayer.mlp.up_proj.weight": noise(inter, d),
        "midlayer.mlp.down_proj.weight": noise(d, inter),
        "norm.weight": weights["model.norm.weight"].clone(),
        "lm_head.weight": lm[ids].clone(),
        "d2t": ids - torch.arange(len(ids)),
        "t2d": t2d,
    }


def layer_config(args: LlamaArgs, draft_vocab: int) -> dict[str, Any]:
    """The draft decoder layer's Llama config (a 256-position table: smaller than the target's on purpose)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "intermediate_size": 2 * args.hidden_size,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": args.vocab_size,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def write_eagle3_dir(
    path: Path,
    args: LlamaArgs,
    tensors: dict[str, torch.Tensor],
    layout: str = "specforge",
    feature_layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> str:
    """An EAGLE-3 checkpoint directory. `layout`: 'specforge' (LlamaForCausalLMEagle3, `midlayer.` names,
    `eagle_config` with output-of-layer ids) or 'speculators' (Eagle3Speculator, `layers.0.` names, the
    layer config nested, vLLM's input-of-layer ids at the top); `feature_layers` None leaves the ids out."""
    path.mkdir(parents=True, exist_ok=True)
    draft_vocab = int(tensors["lm_head.weight"].shape[0])
    cfg = layer_config(args, draft_vocab)
    if layout == "specforge":
        if feature_layers is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": feature_layers, "use_aux_hidden_state": True}
        names = tensors
    else:
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {
                k: v for k, v in cfg.items() if k not in ("architectures", "draft_vocab_size")
            },
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy"},
        }
        if feature_layers is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in feature_layers]
        names = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))
    stored = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in names.items()}
    save_file(stored, str(path / "model.safetensors"))
    return str(path)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] at positions [T]."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.cat([pos[:, None].double() * inv] * 2, -1).float()[:, None, :]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * ang.cos() + half * ang.sin()


@torch.no_grad()
def reference_draft(
    t: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    embed: torch.Tensor,
    tokens: list[int],
    hidden: list[torch.Tensor],
    positions: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 over rows in order, each attending causally to itself and every earlier row: row r reads the
    embedding of tokens[r] and hidden[r], which is a feature vector (3d: through fc) or an earlier row's
    output (d). Returns (outputs [R, d], logits [R, V'])."""
    eps, theta, heads = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    d = t["fc.weight"].shape[0]
    p = "midlayer."
    h = torch.stack([t["fc.weight"] @ x if x.shape[-1] != d else x for x in hidden])
    e = embed[torch.tensor(tokens)]
    x = torch.cat([_rms(e, t[p + "input_layernorm.weight"], eps), _rms(h, t[p + "hidden_norm.weight"], eps)], -1)
    pos = torch.tensor(positions)
    q = _rotate((x @ t[p + "self_attn.q_proj.weight"].T).view(len(tokens), heads, -1), pos, theta)
    k = _rotate((x @ t[p + "self_attn.k_proj.weight"].T).view(len(tokens), kv_heads, -1), pos, theta)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(len(tokens), kv_heads, -1)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    att = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
    y = h + att.reshape(len(tokens), -1) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(y, t[p + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
        p + "mlp.down_proj.weight"
    ].T
    out = y + mlp
    return out, _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T
