"""Qwen2 / Qwen2.5 / Qwen3-style targets: the Llama stack with q/k/v (and optionally output) biases and
per-head RMSNorm of q and k before RoPE.

- Qwen2 (`model_type: qwen2`): biases on q, k and v, none on the output projection.
- Qwen3 (`model_type: qwen3`): `q_norm` / `k_norm` over each head's dimensions, applied before RoPE; biases on
  q, k, v and o only when `attention_bias` is set.
- A Llama config with `attention_bias: true` gets biases on q, k, v and o.

The fused single-kernel path of small steps (input norm, q/k/v projection, RoPE and KV write in one launch)
has no bias or head norm, so these layers run the input norm with the projection (one kernel), then the bias
add and head norms, then the RoPE + KV-write kernel; everything else is the Llama layer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.model import Attention, DecoderLayer, LlamaArgs, LlamaModel, RMSNorm, Rope, load_sharded
from mtpserve.modeling.model import random_llama_weights as _llama_weights
from mtpserve.modeling.parallel import TPContext

MODEL_TYPES = frozenset({"qwen2", "qwen3"})


@dataclass
class QwenArgs(LlamaArgs):
    """Llama hyper-parameters plus the attention variants of Qwen-style layers."""

    qkv_bias: bool = False  # biases on the q, k and v projections
    o_bias: bool = False  # a bias on the output projection
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> QwenArgs:
        """Read an HF config.json dict of a Qwen2, Qwen3 or biased Llama model; ValueError naming a field
        this implementation cannot serve."""
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention layers are not served")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not served")
        base = LlamaArgs.from_hf_dict(cfg)
        model_type = cfg.get("model_type", "llama")
        bias = bool(cfg.get("attention_bias", False))
        if model_type == "qwen2":
            variant = {"qkv_bias": True, "o_bias": False, "qk_norm": False}
        else:
            variant = {"qkv_bias": bias, "o_bias": bias, "qk_norm": model_type == "qwen3"}
        return cls(**{**base.__dict__, **variant})


def is_qwen_style(cfg: dict[str, Any]) -> bool:
    """Whether an HF config needs the Qwen-style layers (a Qwen model type, or a Llama with attention biases)."""
    return cfg.get("model_type") in MODEL_TYPES or bool(cfg.get("attention_bias"))


def qwen_args(args: LlamaArgs) -> QwenArgs:
    """`args` as Qwen-style hyper-parameters; TypeError for another family."""
    if not isinstance(args, QwenArgs):
        raise TypeError(f"a Qwen-style model needs QwenArgs, got {type(args).__name__}")
    return args


class QwenAttention(Attention):
    """GQA attention with optional q/k/v and output biases and per-head q/k RMSNorm."""

    qkv_bias_fused: torch.Tensor | None

    def __init__(self, args: QwenArgs, tp: TPContext) -> None:
        super().__init__(args, tp)
        d, hd = args.hidden_size, self.head_dim
        if args.qkv_bias:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=True)
            self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=True)
            self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=True)
        if args.o_bias:  # replicated on every rank, added once after the sum over ranks
            self.o_proj = nn.Linear(self.num_heads * hd, d, bias=True)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.register_buffer("qkv_bias_fused", None, persistent=False)

    def fuse(self) -> None:
        """Fuse the q/k/v weights (and biases) into one projection."""
        super().fuse()
        if self.q_proj.bias is not None:
            self.qkv_bias_fused = torch.cat([self.q_proj.bias.data, self.k_proj.bias.data, self.v_proj.bias.data])

    def qkv_bias(self) -> torch.Tensor | None:
        """The [q; k; v] bias: the fused one, or the three joined (unprepared modules); None without biases."""
        if self.q_proj.bias is None:
            return None
        if self.qkv_bias_fused is not None:
            return self.qkv_bias_fused
        return torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [.., H, D] and k [.., Hkv, D] through the per-head norms (as they are without them)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def project(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Metadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated q [T, H, D], x + residual): the input norm and projection, bias, head norms, then RoPE
        and the KV write."""
        kv = self.kv_write(rope, k_cache, v_cache, meta)
        qkv, s = self.ops.norm_linear(x, residual, norm.weight, norm.eps, weight=self.qkv_proj_weight())
        bias = self.qkv_bias()
        if bias is not None:
            qkv = qkv + bias
        if self.q_norm is not None:
            t, hd = qkv.shape[0], self.head_dim
            q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
            q, k = self.norm_heads(q.reshape(t, self.num_heads, hd), k.reshape(t, self.num_kv_heads, hd))
            qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v], dim=-1)
        return self.ops.rope_write_kv(qkv, kv), s

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Metadata) -> torch.Tensor:
        """Attend and project back, summed over ranks, plus the output bias."""
        out = super().forward(q, k_cache, v_cache, meta)
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class QwenDecoderLayer(DecoderLayer):
    """The Llama block with Qwen-style attention."""

    def __init__(self, args: QwenArgs, tp: TPContext) -> None:
        super().__init__(args, tp)
        self.self_attn = QwenAttention(args, tp)


class QwenModel(LlamaModel):
    """Decoder stack of a Qwen2 / Qwen3-style (or biased Llama) checkpoint."""

    @classmethod
    def decoder_layer(cls, args: LlamaArgs, tp: TPContext, index: int) -> nn.Module:
        """A Qwen-style decoder layer."""
        return QwenDecoderLayer(qwen_args(args), tp)

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy full HF-named weights into this rank's shard: the Llama tensors, then biases and head norms."""
        load_sharded(self, weights)
        hd = self.args.dim_per_head
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            assert isinstance(att, QwenAttention)
            p = f"model.layers.{i}.self_attn."
            q_rows = slice(att.q_range[0] * hd, att.q_range[1] * hd)
            kv_rows = slice(att.kv_range[0] * hd, att.kv_range[1] * hd)
            for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows), ("o_proj", None)):
                bias = getattr(att, name).bias
                if bias is not None:
                    value = _take(weights, p + name + ".bias")
                    _put(bias, value if rows is None else value[rows], p + name + ".bias")
            for name in ("q_norm", "k_norm"):
                norm = getattr(att, name)
                if norm is not None:
                    _put(norm.weight, _take(weights, p + name + ".weight"), p + name + ".weight")


def _take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise KeyError(f"checkpoint has no tensor '{name}'")
    return weights[name]


def _put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"tensor '{name}': checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    param.copy_(value.to(param.dtype))


def random_qwen_weights(args: QwenArgs, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Full HF-named random weights for `args`: the Llama tensors plus its biases and head norms."""
    w = _llama_weights(args, seed, std)
    g = torch.Generator().manual_seed(seed + 1)
    hd, d = args.dim_per_head, args.hidden_size
    sizes = {"q_proj": args.num_attention_heads * hd, "k_proj": args.num_key_value_heads * hd}
    sizes["v_proj"] = sizes["k_proj"]
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if args.qkv_bias:
            for name, n in sizes.items():
                w[p + name + ".bias"] = torch.randn(n, generator=g) * std
        if args.o_bias:
            w[p + "o_proj.bias"] = torch.randn(d, generator=g) * std
        if args.qk_norm:
            w[p + "q_norm.weight"] = 1.0 + torch.randn(hd, generator=g) * std
            w[p + "k_norm.weight"] = 1.0 + torch.randn(hd, generator=g) * std
    return w
