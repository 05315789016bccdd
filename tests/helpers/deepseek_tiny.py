"""Tiny random DeepSeek-V3-family targets with native MTP modules, for CPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtpserve.modeling.deepseek_config import DeepseekV3Args
from mtpserve.modeling.deepseek_weights import random_deepseek_weights
from tests.helpers.tiny import save_model_dir


def tiny_deepseek_args(**overrides: Any) -> DeepseekV3Args:
    """Two MLA + MoE layers (8 experts in 2 groups, top-2, one shared expert), q and KV low-rank, two MTP
    modules, a small vocabulary."""
    base: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        num_nextn_predict_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(overrides)
    args = DeepseekV3Args(**base)
    args.check()
    return args


def mimic_deepseek_args(**overrides: Any) -> DeepseekV3Args:
    """A one-layer target whose only layer has experts (pairs with `tiny_deepseek_weights(mimic=True)`)."""
    return tiny_deepseek_args(**{"num_hidden_layers": 1, "first_k_dense_replace": 0, **overrides})


def tiny_deepseek_weights(args: DeepseekV3Args, seed: int = 0, mimic: bool = False) -> dict[str, torch.Tensor]:
    """Random weights peaky enough to avoid near-ties. With `mimic` (a one-layer target, see
    `mimic_deepseek_args`), embeddings have unit RMS and every MTP module re-runs the target's layer on the
    next token's embedding (eh_proj passes the embedding only): drafts are often right and often wrong."""
    w = random_deepseek_weights(args, seed=seed, std=0.15)
    if mimic:
        assert args.num_hidden_layers == 1
        g = torch.Generator().manual_seed(seed + 7)
        w["model.embed_tokens.weight"] = torch.randn(args.vocab_size, args.hidden_size, generator=g)
        w["lm_head.weight"] = torch.randn(args.vocab_size, args.hidden_size, generator=g) * 0.3
        last, d = args.num_hidden_layers - 1, args.hidden_size
        src = f"model.layers.{last}."
        assert args.is_moe_layer(last), "the mimic modules copy an expert layer"
        for j in range(args.num_nextn_predict_layers):
            dst = f"model.layers.{args.num_hidden_layers + j}."
            for k in [k for k in w if k.startswith(src)]:
                w[dst + k[len(src) :]] = w[k].clone()
            eh = torch.zeros(d, 2 * d)
            eh[:, :d] = torch.eye(d)
            w[dst + "eh_proj.weight"] = eh
            w[dst + "enorm.weight"] = torch.ones(d)
            w[dst + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    return w


def save_deepseek_dir(path: Any, args: DeepseekV3Args, weights: dict[str, torch.Tensor]) -> str:
    """Write an HF-style DeepSeek-V3 directory (config.json + model.safetensors)."""
    return save_model_dir(path, args, weights, "DeepseekV3ForCausalLM", "deepseek_v3")


def write_tiny_deepseek(directory: Path, seed: int = 0) -> Path:
    """A one-layer mimic DeepSeek-V3 directory with two MTP modules and SmolLM2's tokenizer (for the CLI)."""
    import shutil

    from tests.helpers.service import TOKENIZER_FILES, default_tokenizer_dir

    args = mimic_deepseek_args(vocab_size=49152, bos_token_id=1, eos_token_id=2)
    save_deepseek_dir(directory, args, tiny_deepseek_weights(args, seed=seed, mimic=True))
    src = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, directory / name)
    return directory
