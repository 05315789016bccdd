"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed paged cache.

Each cached token holds one shared row: the normalised KV latent (kv_lora_rank) and the rotated key of the
rotary dims. Attention runs in the absorbed form: each head's no-position query is mapped into the latent
space by its slice of kv_b_proj, so keys and values are read straight from the latent rows and the
per-head keys and values are never materialised; the latent output is mapped back per head before o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtpserve.modeling.attention import Metadata, write_kv
from mtpserve.modeling.deepseek_config import DeepseekV3Args
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.layer_ops import TORCH_OPS, TorchOps, apply_rope
from mtpserve.modeling.model import RMSNorm, Rope
from mtpserve.modeling.parallel import TPContext


@dataclass
class LatentCache(KVCache):
    """`keys[i]` is layer i's latent rows [blocks, block_size, 1, kv_lora_rank + rope_dim]; `values[i]` is a
    view of their first kv_lora_rank columns (the values of absorbed attention), so nothing is stored twice."""

    @classmethod
    def allocate_latent(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        args: DeepseekV3Args,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> LatentCache:
        """Zeroed latent rows for every layer (plus the scratch block); addresses never change."""
        shape = (num_blocks + 1, block_size, 1, args.latent_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, [k[..., : args.kv_lora_rank] for k in keys], block_size)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's latent rows at slots `src` to slots `dst` (the values follow: they are views)."""
        for t in self.keys:
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def nbytes(self) -> int:
        """Bytes held (the value views share the key storage)."""
        return sum(t.numel() * t.element_size() for t in self.keys)


class LatentAttention(nn.Module):
    """MLA holding this rank's share of the query heads; the latent projection is replicated."""

    ops: TorchOps = TORCH_OPS

    def __init__(self, args: DeepseekV3Args, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.args = args
        self.head_range = tp.shard_range(args.num_attention_heads)
        self.num_heads = self.head_range[1] - self.head_range[0]
        if self.num_heads == 0:
            raise ValueError(f"parallel.tp_size={tp.size} exceeds the model's {args.num_attention_heads} heads")
        d, h = args.hidden_size, self.num_heads
        bias = args.attention_bias
        if args.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d, h * args.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, args.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * args.v_head_dim, d, bias=bias)
        self.scale = args.softmax_scale()

    def _absorb(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head (key, value) up-projections [H, nope, rank] and [H, v, rank], views of kv_b_proj."""
        a = self.args
        w = self.kv_b_proj.weight.view(self.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        return w[:, : a.qk_nope_head_dim], w[:, a.qk_nope_head_dim :]

    def _queries(self, h: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(h)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))

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
        """(latent-space queries [T, H, rank + rope_dim], x + residual) of the normed input; writes this
        chunk's latent rows into the cache."""
        a = self.args
        h, s = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        t = h.shape[0]
        q = self._queries(h).view(t, self.num_heads, a.qk_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope
        k_pe = apply_rope(k_pe[:, None, :], cos, sin)
        write_kv(k_cache, meta.slot_mapping, torch.cat([latent[:, None, :], k_pe], dim=-1))
        w_k, _ = self._absorb()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_k)
        return torch.cat([q_latent, apply_rope(q_pe, cos, sin)], dim=-1), s

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Metadata) -> torch.Tensor:
        """Attend over the latent rows and project back (partial sum under TP)."""
        a = self.args
        out = meta.attend_sdpa(q, k_cache, v_cache, self.scale).view(q.shape[0], self.num_heads, a.kv_lora_rank)
        _, w_v = self._absorb()
        heads = torch.einsum("thr,hvr->thv", out, w_v).reshape(q.shape[0], self.num_heads * a.v_head_dim)
        return self.tp.all_reduce(
            self.ops.linear(heads, self.o_proj.weight) if self.o_proj.bias is None else self.o_proj(heads)
        )
