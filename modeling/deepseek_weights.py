"""DeepSeek-V3 checkpoint tensors into (TP-sharded) modules: per-expert or stacked expert names, rotary rows
de-interleaved, MTP modules located by layer index; random weights for tests and dummy loads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mtpserve.modeling.deepseek_config import DeepseekV3Args, deinterleave_rows
from mtpserve.modeling.mla import LatentAttention
from mtpserve.modeling.model import MLP
from mtpserve.modeling.moe import MoE

Take = Callable[[str], torch.Tensor]


def taker(weights: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)) -> Take:
    """A lookup raising KeyError that names the missing tensor; FP8 weights stored with one scale per
    `block` tile (`<name>_scale_inv`, as DeepSeek-V3 ships them) come back dequantised to fp32."""

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint has no tensor '{name}'")
        scale = weights.get(name + "_scale_inv")
        return weights[name] if scale is None else dequantize_blocks(weights[name], scale, block, name)

    return take


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
) -> torch.Tensor:
    """fp32 weight [R, C] from a block-quantised one and its scales [ceil(R/block[0]), ceil(C/block[1])]."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"tensor '{name}': block scales need 2-D weights, got {tuple(weight.shape)}")
    (rows, cols), (br, bc) = weight.shape, block
    if scale_inv.shape != (-(-rows // br), -(-cols // bc)):
        raise ValueError(
            f"tensor '{name}': scales {tuple(scale_inv.shape)} do not tile {tuple(weight.shape)} in {br} x {bc} blocks"
        )
    full = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * full


def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy `value` into `param`; ValueError naming the tensor when the shapes differ."""
    if param.shape != value.shape:
        raise ValueError(f"tensor '{name}': checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    param.copy_(value.to(param.dtype))


def _query_rows(args: DeepseekV3Args) -> torch.Tensor:
    """Row order within one head's query: no-position dims, then the rotary dims as rotate-half halves."""
    rope = torch.arange(args.qk_rope_head_dim)
    if args.rope_interleave:
        rope = deinterleave_rows(args.qk_rope_head_dim)
    return torch.cat([torch.arange(args.qk_nope_head_dim), args.qk_nope_head_dim + rope])


def load_attention(att: LatentAttention, take: Take, p: str, args: DeepseekV3Args) -> None:
    """This rank's heads of one MLA block from tensors named `p` + HF names."""
    hs, he = att.head_range
    rows = _query_rows(args)
    qname = p + ("q_proj.weight" if args.q_lora_rank is None else "q_b_proj.weight")
    q = take(qname)
    q = q.view(args.num_attention_heads, args.qk_head_dim, -1)[hs:he][:, rows].reshape(-1, q.shape[-1])
    target_q = att.q_proj if att.q_proj is not None else att.q_b_proj
    put(target_q.weight, q, qname)
    if args.q_lora_rank is not None:
        put(att.q_a_proj.weight, take(p + "q_a_proj.weight"), p + "q_a_proj.weight")
        put(att.q_a_layernorm.weight, take(p + "q_a_layernorm.weight"), p + "q_a_layernorm.weight")
        if args.attention_bias:
            put(att.q_a_proj.bias, take(p + "q_a_proj.bias"), p + "q_a_proj.bias")
    r = args.kv_lora_rank
    kv_rows = torch.cat([torch.arange(r), r + (rows[args.qk_nope_head_dim :] - args.qk_nope_head_dim)])
    put(att.kv_a_proj_with_mqa.weight, take(p + "kv_a_proj_with_mqa.weight")[kv_rows], p + "kv_a_proj_with_mqa.weight")
    if args.attention_bias:
        name = p + "kv_a_proj_with_mqa.bias"
        put(att.kv_a_proj_with_mqa.bias, take(name)[kv_rows], name)
        put(att.o_proj.bias, take(p + "o_proj.bias") / att.tp.size, p + "o_proj.bias")
    put(att.kv_a_layernorm.weight, take(p + "kv_a_layernorm.weight"), p + "kv_a_layernorm.weight")
    kv_b = take(p + "kv_b_proj.weight")
    per_head = args.qk_nope_head_dim + args.v_head_dim
    put(
        att.kv_b_proj.weight,
        kv_b.view(args.num_attention_heads, per_head, -1)[hs:he].reshape(-1, r),
        p + "kv_b_proj.weight",
    )
    v = args.v_head_dim
    put(att.o_proj.weight, take(p + "o_proj.weight")[:, hs * v : he * v], p + "o_proj.weight")


def load_mlp(mlp: MLP, take: Take, p: str) -> None:
    """This rank's slice of a SwiGLU block from `p` + gate_proj / up_proj / down_proj."""
    ms, me = mlp.range
    put(mlp.gate_proj.weight, take(p + "gate_proj.weight")[ms:me], p + "gate_proj.weight")
    put(mlp.up_proj.weight, take(p + "up_proj.weight")[ms:me], p + "up_proj.weight")
    put(mlp.down_proj.weight, take(p + "down_proj.weight")[:, ms:me], p + "down_proj.weight")


def load_moe(moe: MoE, weights: dict[str, torch.Tensor], take: Take, p: str, args: DeepseekV3Args) -> None:
    """Router, routed experts (per-expert `experts.E.*` or stacked `experts.gate_up_proj`) and shared experts."""
    put(moe.gate.weight, take(p + "gate.weight"), p + "gate.weight")
    bias = weights.get(p + "gate.e_score_correction_bias")
    moe.gate.e_score_correction_bias.copy_(bias if bias is not None else torch.zeros(args.n_routed_experts))
    ms, me = moe.range
    inter = args.moe_intermediate_size
    if p + "experts.gate_up_proj" in weights:
        gate_up = take(p + "experts.gate_up_proj")
        gate_up = torch.cat([gate_up[:, ms:me], gate_up[:, inter + ms : inter + me]], dim=1)
        down = take(p + "experts.down_proj")[:, :, ms:me]
    else:
        e = range(args.n_routed_experts)
        gate_up = torch.stack(
            [
                torch.cat(
                    [take(f"{p}experts.{i}.gate_proj.weight")[ms:me], take(f"{p}experts.{i}.up_proj.weight")[ms:me]]
                )
                for i in e
            ]
        )
        down = torch.stack([take(f"{p}experts.{i}.down_proj.weight")[:, ms:me] for i in e])
    put(moe.experts.gate_up_proj, gate_up, p + "experts.gate_up_proj")
    put(moe.experts.down_proj, down, p + "experts.down_proj")
    if moe.shared_experts is not None:
        load_mlp(moe.shared_experts, take, p + "shared_experts.")


def load_layer(layer: nn.Module, weights: dict[str, torch.Tensor], p: str, args: DeepseekV3Args) -> None:
    """One DeepSeek decoder layer (a target layer or an MTP module's) from tensors under prefix `p`."""
    take = taker(weights, args.weight_block)
    load_attention(layer.self_attn, take, p + "self_attn.", args)  # type: ignore[arg-type]
    put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")  # type: ignore[union-attr, arg-type]
    name = p + "post_attention_layernorm.weight"
    put(layer.post_attention_layernorm.weight, take(name), name)  # type: ignore[union-attr, arg-type]
    if isinstance(layer.mlp, MoE):
        load_moe(layer.mlp, weights, take, p + "mlp.", args=args)
    else:
        load_mlp(layer.mlp, take, p + "mlp.")  # type: ignore[arg-type]


def load_deepseek(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Embedding, final norm, lm_head and every decoder layer of a DeepseekV3Model's shard."""
    args: DeepseekV3Args = model.args
    take = taker(weights, args.weight_block)
    lo, hi = model.embed_tokens.range
    put(model.embed_tokens.weight, take("model.embed_tokens.weight")[lo:hi], "model.embed_tokens.weight")
    if not args.tie_word_embeddings:
        put(model.lm_head_weight, take("lm_head.weight")[lo:hi], "lm_head.weight")
    put(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
    for i, layer in enumerate(model.layers):
        load_layer(layer, weights, f"model.layers.{i}.", args)


def random_deepseek_weights(args: DeepseekV3Args, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Full HF-named random weights (stacked experts), MTP modules included, for tests and dummy loads."""
    g = torch.Generator().manual_seed(seed)
    d = args.hidden_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(args.vocab_size, d)}
    if not args.tie_word_embeddings:
        w["lm_head.weight"] = rnd(args.vocab_size, d)
    w["model.norm.weight"] = 1.0 + rnd(d)
    for i in range(args.num_hidden_layers + args.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        w.update(_random_layer(args, i, p, rnd))
        if i >= args.num_hidden_layers:
            w[p + "enorm.weight"] = 1.0 + rnd(d)
            w[p + "hnorm.weight"] = 1.0 + rnd(d)
            w[p + "eh_proj.weight"] = rnd(d, 2 * d)
            w[p + "shared_head.norm.weight"] = 1.0 + rnd(d)
    return w


def _random_layer(args: DeepseekV3Args, i: int, p: str, rnd: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    d, h, r = args.hidden_size, args.num_attention_heads, args.kv_lora_rank
    a = p + "self_attn."
    w = {
        a + "kv_a_proj_with_mqa.weight": rnd(args.latent_dim, d),
        a + "kv_a_layernorm.weight": 1.0 + rnd(r),
        a + "kv_b_proj.weight": rnd(h * (args.qk_nope_head_dim + args.v_head_dim), r),
        a + "o_proj.weight": rnd(d, h * args.v_head_dim),
        p + "input_layernorm.weight": 1.0 + rnd(d),
        p + "post_attention_layernorm.weight": 1.0 + rnd(d),
    }
    if args.q_lora_rank is None:
        w[a + "q_proj.weight"] = rnd(h * args.qk_head_dim, d)
    else:
        w[a + "q_a_proj.weight"] = rnd(args.q_lora_rank, d)
        w[a + "q_a_layernorm.weight"] = 1.0 + rnd(args.q_lora_rank)
        w[a + "q_b_proj.weight"] = rnd(h * args.qk_head_dim, args.q_lora_rank)
    m = p + "mlp."
    if args.is_moe_layer(i):
        e, inter = args.n_routed_experts, args.moe_intermediate_size
        w[m + "gate.weight"] = rnd(e, d) * 10
        w[m + "gate.e_score_correction_bias"] = rnd(e)
        w[m + "experts.gate_up_proj"] = rnd(e, 2 * inter, d)
        w[m + "experts.down_proj"] = rnd(e, d, inter)
        shared = inter * args.n_shared_experts
        if shared:
            w.update({m + "shared_experts." + k: v for k, v in _random_mlp(d, shared, rnd).items()})
    else:
        w.update({m + k: v for k, v in _random_mlp(d, args.intermediate_size, rnd).items()})
    return w


def _random_mlp(d: int, inter: int, rnd: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"gate_proj.weight": rnd(inter, d), "up_proj.weight": rnd(inter, d), "down_proj.weight": rnd(d, inter)}


@torch.no_grad()
def init_dummy_(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter in place on its own device (norms 1, the rest normal) and zero the buffers
    (routing bias): real shapes without a host copy of the weights, for GPU shape runs."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)
    for b in module.buffers():
        b.zero_()
