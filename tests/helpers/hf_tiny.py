"""Tiny random HF checkpoints of the Llama-family architectures (Llama, Qwen2, Qwen3), written by transformers
itself, and our model loaded from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtpserve.modeling.families import model_class
from mtpserve.modeling.loader import resolve_model
from mtpserve.modeling.model import LlamaModel

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
KINDS = ("llama", "qwen2", "qwen3")


def hf_config(kind: str, **overrides: Any) -> Any:
    """An HF config of `kind` (llama, qwen2 or qwen3) with the tiny shape; Qwen3 gets a head_dim of its own."""
    import transformers

    extra: dict[str, Any] = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if kind == "qwen3":
        extra.update(head_dim=24, tie_word_embeddings=True)
    if kind == "qwen2":
        extra.update(tie_word_embeddings=False)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[kind](**{**SHAPE, **extra, **overrides})


@torch.no_grad()
def write_hf_target(
    path: Path, kind: str, seed: int = 0, std: float = 0.15, mimic: bool = False, **overrides: Any
) -> tuple[str, Any]:
    """Save a randomly initialised HF causal LM of `kind` (biases and norms random too, so that each one shows
    in the logits) into `path`; returns (directory, HF model in eval mode). `mimic`: unit-RMS embeddings,
    an lm_head of std 0.3 and layers of std 0.02, so the next token depends mostly on the current one (a
    draft that reads the next token's embedding drafts well, though not always)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **overrides)).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        scale = std
        if mimic:
            scale = 1.0 if "embed_tokens" in name else 0.3 if name.startswith("lm_head") else 0.02
        p.copy_(base + torch.randn(p.shape, generator=g) * scale)
    hf.save_pretrained(str(path))
    return str(path), hf


def load_ours(path: str) -> LlamaModel:
    """Our model of the checkpoint in `path`, fp32 on CPU, weights loaded."""
    source = resolve_model(path)
    args = source.args()
    model = model_class(args)(args)
    model.load_hf_state_dict(source.weights())
    return model.eval()
