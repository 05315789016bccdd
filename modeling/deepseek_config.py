"""DeepSeek-V3-family hyper-parameters (multi-head latent attention, mixture of experts, MTP modules) and
their rotary table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mtpserve.modeling.model import DRAFT_POSITIONS, LlamaArgs, Rotary

MODEL_TYPES = frozenset({"deepseek_v3"})
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # RoPE tables that do not change with the length


@dataclass
class DeepseekV3Args(LlamaArgs):
    """A DeepSeek-V3 config.json, named as in HF DeepseekV3Config. The Llama fields keep their meaning
    (`intermediate_size` is the dense layers' width); the rest describe MLA, the experts and the MTP modules."""

    q_lora_rank: int | None = None  # None: queries are projected straight from the hidden state
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    first_k_dense_replace: int = 3
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0
    rope_interleave: bool = True
    attention_bias: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    quantization_config: dict[str, Any] = field(default_factory=dict)  # FP8 checkpoints: weight_block_size

    @property
    def weight_block(self) -> tuple[int, int]:
        """Rows and columns per scale of block-quantised (FP8) weights; DeepSeek-V3 ships 128 x 128."""
        rows, cols = self.quantization_config.get("weight_block_size") or (128, 128)
        return int(rows), int(cols)

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> DeepseekV3Args:
        """Read a DeepSeek-V3 config.json dict; older `rope_scaling` keys are folded into `rope_parameters`."""
        names = cls.__dataclass_fields__
        kwargs = {k: cfg[k] for k in names if k in cfg and cfg[k] is not None}
        kwargs.pop("head_dim", None)  # HF stores the rotary width there; MLA has no single head size
        kwargs.pop("rope_scaling", None)  # read into rope_parameters below
        if cfg.get("q_lora_rank") is None:
            kwargs["q_lora_rank"] = None
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        kwargs["rope_parameters"] = rope
        kwargs["rope_theta"] = rope["rope_theta"]
        args = cls(**kwargs)
        args.check()
        return args

    def check(self) -> None:
        """Raise ValueError naming the first field that this implementation cannot serve."""
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError("each expert group needs at least two experts (routing sums a group's top two)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts of the selected groups")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            served = ", ".join(STATIC_ROPE_TYPES)
            raise ValueError(f"rope_parameters.rope_type '{rope_type}' is not served (fixed tables only: {served})")

    @property
    def dim_per_head(self) -> int:
        """The rotary width (what RoPE tables are built for)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head before absorption: no-position part plus rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: the compressed KV latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (MTP modules included) has routed experts."""
        return index >= self.first_k_dense_replace

    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale squared when the rotary table is YaRN-scaled."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_parameters
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
            scale *= m * m
        return scale


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context extended `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class ScaledRotary(Rotary):
    """Rotate-half RoPE over the rotary dims from HF's rope initialisers (default, YaRN, ...), with their
    cos/sin scaling. Interleaved checkpoints are de-interleaved at load time, so one rotation serves both."""

    def __init__(self, args: DeepseekV3Args) -> None:
        torch.nn.Module.__init__(self)
        with torch.device("cpu"):  # a table, also when the model is being laid out on the meta device
            inv_freq, scaling = rope_frequencies(args)
            positions = torch.arange(args.max_position_embeddings + DRAFT_POSITIONS, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq.float())
            emb = torch.cat([freqs, freqs], dim=-1)
        self.register_tables((emb.cos() * scaling).float(), (emb.sin() * scaling).float())


def rope_frequencies(args: DeepseekV3Args) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2], cos/sin scaling) as HF computes them for this config."""
    rope = args.rope_parameters
    dim = args.qk_rope_head_dim
    if rope.get("rope_type", "default") == "default":
        theta = float(rope.get("rope_theta", args.rope_theta))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = DeepseekV3Config(
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        qk_rope_head_dim=dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters=dict(rope),
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    return inv_freq, float(scaling)


def deinterleave_rows(dim: int) -> torch.Tensor:
    """Row order turning interleaved rotary pairs (x0, x1), (x2, x3), ... into rotate-half halves."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
