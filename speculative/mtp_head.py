"""The MTP Eagle draft head (DeepSeek-V3 MTP layout), sharing the target's embedding and output head.

Safetensors tensor names (all under the `mtp.` prefix):
- mtp.enorm.weight [d], mtp.hnorm.weight [d]             RMSNorm of the embedding and of the hidden state
- mtp.eh_proj.weight [d, 2d]                             projection of concat(enorm(e), hnorm(h))
- mtp.layer.<HF Llama decoder-layer names>              one decoder layer, e.g.
  mtp.layer.self_attn.q_proj.weight, mtp.layer.mlp.down_proj.weight, mtp.layer.input_layernorm.weight
The embedding, final norm and lm_head are the target's and are not stored.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.attention import Metadata
from workers.draft_kernels import DraftInputWeights
from workers.kv_cache import KVCache
from workers.model import DecoderLayer, LlamaArgs, LlamaModel, RMSNorm, Rope, Rotary
from workers.parallel import TPContext

PREFIX = "mtp."


class MTPEagleHead(nn.Module):
    """enorm(embed(token)) ++ hnorm(hidden) -> eh_proj -> one decoder layer -> hidden for the shared head."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.args = args
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(args, TPContext())
        self.rotary = Rotary(args.dim_per_head, args.rope_theta, args.max_position_embeddings)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: Metadata,
    ) -> torch.Tensor:
        """Draft hidden states [T, d] for rows reading (embedding of token i+1, hidden at i)."""
        return self._layer(self._input(embeds, hidden), self.rotary.table(positions), cache, meta)

    def step(
        self,
        shared: LlamaModel,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: Metadata,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """`forward` for token ids [T], embedded with `shared`'s table (one kernel with the input norms and
        eh_proj where the ops allow). `rope` may hold the cos/sin rows of `positions`, computed ahead."""
        if shared.tp.size > 1:
            x = self._input(shared.embed(tokens), hidden)
        else:
            e = self.enorm
            weights = DraftInputWeights(
                shared.embed_tokens.weight, e.weight, self.hnorm.weight, e.eps, self.eh_proj.weight
            )
            x = e.ops.draft_input(tokens, hidden, weights)
        return self._layer(x, self.rotary.table(positions) if rope is None else rope, cache, meta)

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))

    def _layer(self, x: torch.Tensor, rope: Rope, cache: KVCache, meta: Metadata) -> torch.Tensor:
        return self.layer(x, rope, cache.keys[0], cache.values[0], meta)

    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> KVCache:
        """The draft's own one-layer paged KV cache."""
        dtype = self.eh_proj.weight.dtype
        return KVCache.allocate(
            1, num_blocks, block_size, self.args.num_key_value_heads, self.args.dim_per_head, dtype, device
        )

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random initialisation (tests, or an explicit untrained head)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def init_from_target(self, target_weights: dict[str, torch.Tensor], layer: int | None = None) -> None:
        """Copy the target's last (or given) decoder layer into the head; eh_proj starts as [0 | I]."""
        idx = self.args.num_hidden_layers - 1 if layer is None else layer
        prefix = f"model.layers.{idx}."
        sd = {k[len(prefix) :]: v for k, v in target_weights.items() if k.startswith(prefix)}
        self.layer.load_state_dict(sd)
        d = self.args.hidden_size
        with torch.no_grad():
            self.enorm.weight.fill_(1.0)
            self.hnorm.weight.fill_(1.0)
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, d:] = torch.eye(d)
            self.eh_proj.weight[:, :d] = torch.eye(d) * 0.1

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """Write the head as safetensors under the `mtp.` prefix."""
        tensors = {PREFIX + k: v.detach().to(torch.float32).contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, args: LlamaArgs) -> MTPEagleHead:
        """Read a head saved by `save`; shapes must match the target's architecture."""
        raw = load_file(str(path))
        sd = {k[len(PREFIX) :]: v for k, v in raw.items() if k.startswith(PREFIX)}
        head = cls(args)
        missing, unexpected = head.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: draft head tensors missing {missing[:3]} / unexpected {unexpected[:3]}")
        return head
