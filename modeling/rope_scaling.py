"""RoPE frequencies of Llama-family configs, scaled ones included (Llama 3's `llama3`, `linear`, `yarn`): the
fixed tables HF's initialisers compute for them. Scalings that change the table with the sequence length
(`dynamic`, `longrope`) are not served."""

from __future__ import annotations

from typing import Any

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn")


def rope_scaling_of(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """An HF config's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) with its type under
    `rope_type` and without `rope_theta`; None for plain RoPE. ValueError naming the field for a type without
    a fixed table."""
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(field) or {})
    params.pop("rope_theta", None)
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type == "default":
        return None
    if rope_type not in STATIC_TYPES:
        served = ", ".join(STATIC_TYPES)
        raise ValueError(f"{field}.rope_type '{rope_type}' is not served (fixed tables only: {served})")
    return {**params, "rope_type": rope_type}


def rope_frequencies(
    head_dim: int, theta: float, max_pos: int, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] in float64, cos/sin scaling): plain RoPE's, or those HF computes for
    the scaled type, on the current default device."""
    if scaling is None:
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # a table, also while a model is laid out on the meta device
        hf = LlamaConfig(
            hidden_size=head_dim,
            num_attention_heads=1,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters={**scaling, "rope_theta": theta},
        )
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    return inv_freq.double().to(torch.empty(0).device), float(attention_scaling)
