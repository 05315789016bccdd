"""Dense (non-paged) forwards for training: the target over padded batches, and the unrolled draft head.

They reuse the modules' own weights (embedding, q/k/v/o, MLP, norms, rotary tables), so on CPU fp32 they
match the paged model numerically. Batches are right-padded: with causal attention, real rows never
see padding, and padded rows are masked out of every loss and metric.

Unrolled head (training-time test). Let t be the tokens, H the target hidden states, and q a position.
Step 1, row q reads (embed(t[q+1]), H[q]); it is the chain's first step from base p = q.
Step k > 1, row q reads (embed(t[q+1]), h_{k-1}[q-1]), where h_{k-1} is step k-1's output. It is the
chain's k-th step from base p = q - k + 1. At inference that step's query attends to the draft KV of
positions <= p, written from target hidden states (step-1 keys), and to the chain's own keys at
p+1..q, one per earlier step (step j's key at position p + j - 1). `unroll_mask` encodes exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpserve.modeling import layer_ops
from mtpserve.modeling.model import Attention, DecoderLayer, LlamaModel, Rotary
from mtpserve.modeling.qwen import QwenAttention
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.eagle3_head import Eagle3Head
from mtpserve.speculative.mtp_head import MTPEagleHead

KV = tuple[torch.Tensor, torch.Tensor]


def apply_rope(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE for x [B, L, H, D] at positions [L] (or [B, L]), computed in fp32 like `Rotary`."""
    return layer_ops.apply_rope(x, rotary.cos[positions].unsqueeze(-2), rotary.sin[positions].unsqueeze(-2))


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], n, d)


def attention(
    att: Attention,
    rotary: Rotary,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    past: list[KV],
) -> tuple[torch.Tensor, KV]:
    """Self-attention of x [B, L, d]; keys are past keys then this block's; returns (out, this block's KV).

    mask: None for plain causal attention over this block only, else bool [L, S] (True = may attend)
    over S = (len(past) + 1) * L keys. KV tensors are [B, Hkv, L, D] after RoPE.
    """
    if att.tp.size != 1:
        raise ValueError("dense training forwards need an unsharded (tp=1) model")
    hd = att.head_dim
    q, k = _heads(att.q_proj(x), att.num_heads, hd), _heads(att.k_proj(x), att.num_kv_heads, hd)
    if isinstance(att, QwenAttention):
        q, k = att.norm_heads(q, k)
    q = apply_rope(rotary, q, positions).transpose(1, 2)
    k = apply_rope(rotary, k, positions).transpose(1, 2)
    v = _heads(att.v_proj(x), att.num_kv_heads, hd).transpose(1, 2)
    keys = torch.cat([*(p[0] for p in past), k], dim=2) if past else k
    values = torch.cat([*(p[1] for p in past), v], dim=2) if past else v
    group = att.num_heads // att.num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=att.scale)
    out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], att.num_heads * hd)
    return att.o_proj(out), (k, v)


def llama_layers(head: MTPEagleHead) -> list[DecoderLayer]:
    """The head's decoder layers; training-time unrolling is written for Llama-family layers only."""
    layers = []
    for layer in head.decoder_layers:
        if not isinstance(layer, DecoderLayer) or not isinstance(layer.self_attn, Attention):
            raise ValueError(f"train-draft trains heads of Llama-family targets, not {type(layer).__name__}")
        layers.append(layer)
    return layers


def decoder_layer(
    layer: DecoderLayer,
    rotary: Rotary,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None = None,
    past: list[KV] | None = None,
) -> tuple[torch.Tensor, KV]:
    """One pre-norm block over x [B, L, d] (see `attention` for mask and past); returns (x, KV)."""
    a, kv = attention(layer.self_attn, rotary, layer.input_layernorm(x), positions, mask=mask, past=past or [])
    x = x + a
    return x + layer.mlp(layer.post_attention_layernorm(x)), kv


def target_hidden(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Pre-final-norm hidden states [B, L, d] of right-padded token ids [B, L] (causal, no cache)."""
    return target_features(model, ids, (len(model.layers) - 1,))[:, :, 0]


def target_features(model: LlamaModel, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """Outputs of the given layers [B, L, len(layers), d] for right-padded token ids [B, L] (causal, no cache);
    layer L-1's output is the pre-final-norm hidden state."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = model.embed(ids)
    taps: list[torch.Tensor] = []
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        x, _ = decoder_layer(layer, model.rotary, x, positions)
        if i in layers:
            taps.append(x)
    if len(taps) != len(layers):
        raise ValueError(f"feature layers {list(layers)} are not all within the target's {len(model.layers)} layers")
    return torch.stack(taps, dim=2)


def unroll_mask(length: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [L, step*L]: which keys step `step` (1-based) may attend to, row q, key block j.

    Block 1 (step-1 keys): positions <= q - step + 1 (the chain's base and before).
    Block j >= 2: only position q - (step - j), the chain's own step-j row (j = step is the row itself).
    """
    q = torch.arange(length, device=device)[:, None]
    s = torch.arange(length, device=device)[None, :]
    blocks = [s <= q - step + 1]
    blocks += [s == q - (step - j) for j in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def head_unrolled(
    head: DraftHead, shared: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Draft hidden states per unrolled step, each [B, L, d]; row q of step k predicts token q + k + 1.

    ids [B, L] right-padded tokens; hidden [B, L, n*d] the target features the head reads (its
    `feature_layers`' outputs, concatenated; n = 1: the pre-norm hidden states).
    Later steps read the token at q + 1 (teacher forcing, which is what a fully accepted chain sees).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(head, Eagle3Head):
        return eagle3_unrolled(head, shared, ids, hidden, steps=steps)
    if not isinstance(head, MTPEagleHead):
        raise ValueError(f"train-draft does not unroll {type(head).__name__} heads")
    length = ids.shape[1]
    next_ids = F.pad(ids[:, 1:], (0, 1))
    emb = head.enorm(shared.embed(next_ids))
    positions = torch.arange(length, device=ids.device)
    layers = llama_layers(head)
    past: list[list[KV]] = [[] for _ in layers]  # per decoder layer, one block of keys per earlier step
    outs: list[torch.Tensor] = []
    h_in = head.project(hidden)
    for k in range(1, steps + 1):
        out = head.eh_proj(torch.cat([emb, head.hnorm(h_in.to(emb.dtype))], dim=-1))
        mask = None if k == 1 else unroll_mask(length, k, ids.device)
        for layer, layer_past in zip(layers, past, strict=True):
            out, kv = decoder_layer(layer, head.rotary, out, positions, mask=mask, past=layer_past)
            layer_past.append(kv)
        outs.append(out)
        h_in = F.pad(out[:, :-1], (0, 0, 1, 0))
    return outs


def eagle3_unrolled(
    head: Eagle3Head, shared: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """`head_unrolled` for an EAGLE-3 head: its layer attends over concat(normed embedding, normed hidden),
    with the hidden state (fc of the features, then the previous step's output) as the residual."""
    length = ids.shape[1]
    m = head.midlayer
    emb = m.input_layernorm(head.embed(shared, F.pad(ids[:, 1:], (0, 1))))
    positions = torch.arange(length, device=ids.device)
    past: list[KV] = []
    outs: list[torch.Tensor] = []
    h_in = head.project(hidden)
    for k in range(1, steps + 1):
        h = m.hidden_norm(h_in)
        mask = None if k == 1 else unroll_mask(length, k, ids.device)
        a, kv = attention(m.self_attn, head.rotary, torch.cat([emb, h], dim=-1), positions, mask=mask, past=past)
        past.append(kv)
        x = (h if m.norm_before_residual else h_in) + a
        out = x + m.mlp(m.post_attention_layernorm(x))
        outs.append(out)
        h_in = F.pad(out[:, :-1], (0, 0, 1, 0))
    return outs
