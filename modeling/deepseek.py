"""DeepSeek-V3-family target: the Llama model's stack with MLA attention, MoE layers after the first
`first_k_dense_replace`, a latent paged cache and a scaled rotary table."""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.deepseek_config import DeepseekV3Args, ScaledRotary
from mtpserve.modeling.deepseek_weights import load_deepseek
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.mla import LatentAttention, LatentCache
from mtpserve.modeling.model import MLP, DecoderLayer, LlamaArgs, LlamaModel, RMSNorm, Rope, Rotary
from mtpserve.modeling.moe import MoE
from mtpserve.modeling.parallel import TPContext


def deepseek_args(args: LlamaArgs) -> DeepseekV3Args:
    """`args` as DeepSeek-V3 hyper-parameters; TypeError for another family."""
    if not isinstance(args, DeepseekV3Args):
        raise TypeError(f"a DeepSeek-V3 model needs DeepseekV3Args, got {type(args).__name__}")
    return args


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm MLA + (dense SwiGLU or MoE) block; `step` defers the last residual add like the Llama layer."""

    def __init__(self, args: DeepseekV3Args, tp: TPContext, index: int) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LatentAttention(args, tp)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args, tp) if args.is_moe_layer(index) else MLP(args, tp)  # type: ignore[assignment]

    def step(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Metadata,
        whole: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer with its last residual add deferred, or done with `whole` (see `DecoderLayer.step`)."""
        q, residual = self.self_attn.project(
            x, residual, norm=self.input_layernorm, rope=rope, k_cache=k_cache, v_cache=v_cache, meta=meta
        )
        a = self.self_attn(q, k_cache, v_cache, meta)
        post = self.post_attention_layernorm
        h, residual = post.ops.add_rms_norm(a, residual, post.weight, post.eps)
        out = self.mlp(h)
        return (out + residual, None) if whole else (out, residual)


class DeepseekV3Model(LlamaModel):
    """Decoder stack of a DeepSeek-V3-family checkpoint (its MTP modules are draft heads, not layers here)."""

    ragged_capture = False  # latent attention reads a ragged step's lengths on the host

    @classmethod
    def decoder_layer(cls, args: LlamaArgs, tp: TPContext, index: int) -> nn.Module:
        """An MLA layer, with experts from `first_k_dense_replace` on (MTP modules included)."""
        return DeepseekDecoderLayer(deepseek_args(args), tp, index)

    @classmethod
    def rotary_for(cls, args: LlamaArgs) -> Rotary:
        """The rotary dims' table with the checkpoint's scaling (YaRN for DeepSeek-V3)."""
        return ScaledRotary(deepseek_args(args))

    @classmethod
    def cache_for(
        cls,
        args: LlamaArgs,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPContext | None = None,
    ) -> KVCache:
        """One latent row per token and layer, the same on every rank."""
        return LatentCache.allocate_latent(
            num_layers, num_blocks, block_size, deepseek_args(args), dtype=dtype, device=device
        )

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy full HF-named DeepSeek-V3 weights into this rank's shard (MTP module tensors are skipped)."""
        load_deepseek(self, weights)
