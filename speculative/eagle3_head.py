"""The EAGLE-3 draft head: fc fuses the target features, one decoder layer reads the normed token embedding
and the normed fused hidden state side by side, and its own norm and lm_head score a reduced vocabulary.

Row i (the token at i+1, features at i):
    h = fc(features)                 (a chained step reads the previous step's output h as it is)
    x = concat(input_layernorm(embed(token)), hidden_norm(h))          [2d]
    a = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))             RoPE at position i, own paged KV
    y = h + a                        (normed h with norm_before_residual)
    out = y + mlp(post_attention_layernorm(y))                         the step's output, d wide
    logits = lm_head(norm(out))      over the V' draft tokens; draft row r is target token vocab_ids[r]
The file format is `eagle3_config.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import MLP, Attention, LlamaArgs, LlamaModel, RMSNorm, Rope
from mtpserve.modeling.parallel import TPContext
from mtpserve.speculative import eagle3_config as fmt
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.mtp_head import check_vocab_ids


def layer_args_for(target: LlamaArgs) -> LlamaArgs:
    """Hyper-parameters of a draft layer shaped like the target's layers (what train-draft builds)."""
    return dataclasses.replace(target, num_hidden_layers=1)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over concat(normed embedding, normed hidden), then a SwiGLU MLP."""

    def __init__(self, args: LlamaArgs, norm_before_residual: bool = False) -> None:
        super().__init__()
        d = args.hidden_size
        self.input_layernorm = RMSNorm(d, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, args.rms_norm_eps)
        self.self_attn = Attention(args, TPContext())
        att = self.self_attn
        att.q_proj = nn.Linear(2 * d, att.num_heads * att.head_dim, bias=False)
        att.k_proj = nn.Linear(2 * d, att.num_kv_heads * att.head_dim, bias=False)
        att.v_proj = nn.Linear(2 * d, att.num_kv_heads * att.head_dim, bias=False)
        self.post_attention_layernorm = RMSNorm(d, args.rms_norm_eps)
        self.mlp = MLP(args, TPContext())
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Metadata,
    ) -> torch.Tensor:
        """The layer's output [T, d] for token embeddings and hidden states [T, d]; writes this step's K/V."""
        ops, att, post = self.input_layernorm.ops, self.self_attn, self.post_attention_layernorm
        h = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)
        kv = att.kv_write(rope, k_cache, v_cache, meta)
        q = ops.rope_write_kv(ops.linear(x, att.qkv_proj_weight()), kv)
        a = att(q, k_cache, v_cache, meta)
        residual = h if self.norm_before_residual else hidden
        gate_up, residual = ops.norm_linear(a, residual, post.weight, post.eps, weight=self.mlp.gate_up_proj_weight())
        return self.mlp.down(gate_up, residual)


class Eagle3Head(DraftHead):
    """An EAGLE-3 draft for a target with hyper-parameters `args`: its layer shaped by `layer` (the draft
    config's), reading the outputs of `feature_layers`, drafting the target tokens `vocab_ids` (None: all).
    Without an own lm_head it scores with the target's; without an own embedding it embeds with the target's."""

    lm_head: nn.Linear | None
    embed_tokens: nn.Embedding | None

    def __init__(
        self,
        args: LlamaArgs,
        feature_layers: Sequence[int],
        vocab_ids: torch.Tensor | None = None,
        layer: LlamaArgs | None = None,
        own_lm_head: bool = True,
        own_embedding: bool = False,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        self.args = args
        self.layer_args = layer or layer_args_for(args)
        self.mlp_size = self.layer_args.intermediate_size
        d = self.layer_args.hidden_size
        if d != args.hidden_size:
            raise fmt.Eagle3FormatError("hidden_size", f"{d}, but the target's hidden size is {args.hidden_size}")
        self.feature_layers = tuple(feature_layers)
        fmt.check_feature_layers(self.feature_layers, args.num_hidden_layers, "feature_layers")
        self.normed_input = False
        if vocab_ids is not None:
            check_vocab_ids(vocab_ids, args.vocab_size)
            self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())
        else:
            self.vocab_ids = None
        self.fc = nn.Linear(self.feature_size, d, bias=False)
        self.midlayer = Eagle3Layer(self.layer_args, norm_before_residual)
        self.norm = RMSNorm(d, self.layer_args.rms_norm_eps)
        if not own_lm_head and vocab_ids is not None:
            raise fmt.Eagle3FormatError("lm_head.weight", "a reduced draft vocabulary needs the draft's own lm_head")
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False) if own_lm_head else None
        self.embed_tokens = nn.Embedding(args.vocab_size, d) if own_embedding else None
        positions = max(self.layer_args.max_position_embeddings, args.max_position_embeddings)
        self.rotary = LlamaModel.rotary_for(dataclasses.replace(self.layer_args, max_position_embeddings=positions))

    # ---- layout --------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """One decoder layer per draft step."""
        return 1

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's weights."""
        return self.fc.weight.dtype

    def spec(self) -> fmt.Eagle3Spec:
        """The shape a config.json records."""
        nbr = self.midlayer.norm_before_residual
        return fmt.Eagle3Spec(self.layer_args, self.draft_vocab_size, self.feature_layers, nbr)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target features [.., n*d] through fc to [.., d]; a d-wide hidden state (a draft output) as is."""
        if hidden.shape[-1] == self.feature_size:
            return self.fc(hidden.to(self.fc.weight.dtype))
        return hidden.to(self.fc.weight.dtype)

    def embed(self, shared: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, d]: the draft's own table, or the target's."""
        e = shared.embed(tokens) if self.embed_tokens is None else self.embed_tokens(tokens)
        return e.to(self.dtype)

    # ---- forward -------------------------------------------------------------------------------------
    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: Metadata
    ) -> torch.Tensor:
        """Draft hidden states [T, d] for rows reading (embedding of token i+1, features or hidden at i)."""
        rope = self.rotary.table(positions)
        return self.midlayer(
            embeds.to(self.dtype),
            self.project(hidden),
            rope=rope,
            k_cache=cache.keys[0],
            v_cache=cache.values[0],
            meta=meta,
        )

    def _step(
        self,
        shared: LlamaModel,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: Metadata,
        rope: Rope | None,
    ) -> torch.Tensor:
        """`forward` for token ids [T]; `rope` may hold the cos/sin rows of `positions`, computed ahead."""
        rope = self.rotary.table(positions) if rope is None else rope
        e, h = self.embed(shared, tokens), self.project(hidden)
        return self.midlayer(e, h, rope=rope, k_cache=cache.keys[0], v_cache=cache.values[0], meta=meta)

    # ---- output head ---------------------------------------------------------------------------------
    def logits(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V'] over the draft vocabulary (differentiable through `hidden`)."""
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return F.linear(normed, self.lm_head.weight).float()
        local = F.linear(normed.to(shared.lm_head_weight.dtype), shared.lm_head_weight)
        return shared.tp.all_gather_last(local, shared.vocab_sizes).float()

    def _greedy_tokens(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax token per row [N], as target token ids (without logits where the ops allow)."""
        n = self.norm
        if self.lm_head is not None:
            return self.token_ids(n.ops.norm_argmax(hidden, n.weight, n.eps, self.lm_head.weight))
        if shared.tp.size > 1:
            return super().greedy_tokens(shared, hidden)
        return n.ops.norm_argmax(hidden, n.weight, n.eps, shared.lm_head_weight)

    # ---- set-up --------------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> KVCache:
        """The draft's own paged KV cache: one layer of the draft layer's KV heads."""
        la = self.layer_args
        return KVCache.allocate(
            num_layers=1,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=la.num_key_value_heads,
            head_dim=la.dim_per_head,
            dtype=self.dtype,
            device=device,
        )

    @torch.no_grad()
    def init_from_target(self, target_weights: dict[str, torch.Tensor], layer: int | None = None) -> None:
        """Start from the target (a head shaped like its layers): the last (or given) decoder layer's weights,
        q/k/v reading [0.1 x embedding | hidden], fc passing the last feature layer through, the target's
        final norm and lm_head rows."""
        idx = self.args.num_hidden_layers - 1 if layer is None else layer
        p = f"model.layers.{idx}."
        m = self.midlayer
        for name in ("q_proj", "k_proj", "v_proj"):
            w = target_weights[p + f"self_attn.{name}.weight"]
            getattr(m.self_attn, name).weight.copy_(torch.cat([0.1 * w, w], dim=1))
        m.self_attn.o_proj.weight.copy_(target_weights[p + "self_attn.o_proj.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(target_weights[p + f"mlp.{name}.weight"])
        ln = target_weights[p + "input_layernorm.weight"]
        m.input_layernorm.weight.copy_(ln)
        m.hidden_norm.weight.copy_(ln)
        m.post_attention_layernorm.weight.copy_(target_weights[p + "post_attention_layernorm.weight"])
        d = self.args.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -d:] = torch.eye(d)
        self.norm.weight.copy_(target_weights["model.norm.weight"])
        if self.lm_head is not None:
            lm = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
            self.lm_head.weight.copy_(lm if self.vocab_ids is None else lm[self.vocab_ids])

    def init_from_head(self, other: DraftHead) -> None:
        """Start from another EAGLE-3 head of the same shape (a trained head to continue)."""
        mine = self.state_dict()
        theirs = other.state_dict() if isinstance(other, Eagle3Head) else {}
        if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
            raise ValueError("cannot start from a head of another layout, feature layers or draft vocabulary")
        self.load_state_dict(theirs)

    # ---- files ---------------------------------------------------------------------------------------
    def save(
        self, path: str | Path, metadata: dict[str, str] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        """Write the head as an EAGLE-3 checkpoint directory: config.json and model.safetensors (floating
        tensors in `dtype`); `metadata` goes into the safetensors header and config.json's `mtpserve` entry."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v for k, v in self.state_dict().items() if k != "vocab_ids"}
        ids = self.vocab_ids if self.vocab_ids is not None else torch.arange(self.args.vocab_size)
        tensors["d2t"] = ids.cpu() - torch.arange(len(ids))
        t2d = torch.zeros(self.args.vocab_size, dtype=torch.bool)
        t2d[ids.cpu()] = True
        tensors["t2d"] = t2d
        tensors = {k: _stored(v, dtype) for k, v in tensors.items()}
        meta = dict(metadata or {})
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        extra = {"mtpserve": meta} if meta else None
        cfg = fmt.hf_config(self.args, self.layer_args, self.spec(), dtype, extra=extra)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    @classmethod
    def load(cls, path: str | Path, args: LlamaArgs) -> Eagle3Head:
        """Read an EAGLE-3 checkpoint directory for a target with hyper-parameters `args`; Eagle3FormatError
        naming the field or tensor that does not fit."""
        directory = Path(path)
        spec = fmt.parse_spec(fmt.read_config(directory), args)
        tensors = fmt.read_tensors(directory)
        vocab_ids = fmt.vocab_ids_of(tensors, spec.draft_vocab_size, args.vocab_size)
        head = cls(
            args,
            spec.feature_layers,
            vocab_ids,
            spec.layer,
            own_lm_head="lm_head.weight" in tensors,
            own_embedding="embed_tokens.weight" in tensors,
            norm_before_residual=spec.norm_before_residual,
        )
        head.load_tensors(tensors)
        return head

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy canonical-named tensors into the head (as fp32); Eagle3FormatError naming a missing, unknown
        or misshapen tensor."""
        own: dict[str, Any] = {k: v for k, v in self.state_dict().items() if k != "vocab_ids"}
        unknown = sorted(set(tensors) - set(own) - {"d2t", "t2d"})
        if unknown:
            raise fmt.Eagle3FormatError(unknown[0], f"unexpected tensor ({len(unknown)} in all); one layer is served")
        for name, dst in own.items():
            if name not in tensors:
                raise fmt.Eagle3FormatError(name, "missing from the checkpoint")
            src = tensors[name]
            if src.shape != dst.shape:
                raise fmt.Eagle3FormatError(name, f"shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src.float())


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as written: on the host, contiguous, floating ones in `dtype`."""
    t = t.detach().cpu()
    return (t.to(dtype) if t.is_floating_point() else t).contiguous()
