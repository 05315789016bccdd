"""Llama-family transformer with paged KV and tensor-parallel sharding (no HF modules at run time)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.modeling import kernel_choices
from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.kv_cache import KVCache, KVWrite
from mtpserve.modeling.layer_ops import TORCH_OPS, TorchOps
from mtpserve.modeling.parallel import TPContext
from mtpserve.modeling.rope_scaling import rope_frequencies, rope_scaling_of


@dataclass
class LlamaArgs:
    """Architecture hyper-parameters, named as in HF LlamaConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope_scaling: dict[str, Any] | None = None  # a scaled RoPE's parameters (`rope_scaling_of`); None: plain

    @property
    def dim_per_head(self) -> int:
        """Head dimension (explicit or hidden/heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> LlamaArgs:
        """Read the fields we use from an HF config.json dict; ValueError naming a field we cannot serve."""
        names = cls.__dataclass_fields__
        kwargs = {k: cfg[k] for k in names if k in cfg and cfg[k] is not None}
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        kwargs["rope_scaling"] = rope_scaling_of(cfg)
        return cls(**kwargs)

    def eos_ids(self) -> list[int]:
        """EOS ids as a list."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in fp32."""

    ops: TorchOps = TORCH_OPS

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim."""
        return self.ops.add_rms_norm(x, None, self.weight, self.eps)[0]


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim] fp32


# Rows the RoPE tables hold past the last position, for drafts past max_model_len (cut off); no chain or tree is deeper.
DRAFT_POSITIONS = 64


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table (plain, or scaled as `rope_scaling` says) for
    positions up to max_pos + DRAFT_POSITIONS."""

    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_pos: int, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # a layout only: the table is built with the storage
            self.register_buffer("cos_sin", torch.empty(max_pos + DRAFT_POSITIONS, 2 * head_dim), persistent=False)
            return
        inv, attention_scaling = rope_frequencies(head_dim, theta, max_pos, scaling)
        freqs = torch.outer(torch.arange(max_pos + DRAFT_POSITIONS, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_tables((emb.cos() * attention_scaling).float(), (emb.sin() * attention_scaling).float())

    def register_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Keep the cos and sin tables [max_pos, head_dim] side by side in one buffer, so that one gather
        serves both."""
        self.register_buffer("cos_sin", torch.cat([cos, sin], dim=-1), persistent=False)

    @property
    def cos(self) -> torch.Tensor:
        """The cos table [max_pos, head_dim] (a view)."""
        return self.cos_sin.chunk(2, dim=-1)[0]

    @property
    def sin(self) -> torch.Tensor:
        """The sin table [max_pos, head_dim] (a view)."""
        return self.cos_sin.chunk(2, dim=-1)[1]

    def table(self, positions: torch.Tensor) -> Rope:
        """cos/sin rows for `positions` [T], gathered once per forward (in one launch) and shared by every
        layer."""
        cos, sin = self.cos_sin[positions][:, None, :].chunk(2, dim=-1)
        return cos, sin


class Attention(nn.Module):
    """GQA self-attention holding this rank's KV-head groups and their query heads."""

    ops: TorchOps = TORCH_OPS
    qkv_weight: torch.Tensor | None

    def __init__(self, args: LlamaArgs, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.head_dim = args.dim_per_head
        group = args.num_attention_heads // args.num_key_value_heads
        self.kv_range = tp.kv_head_range(args.num_key_value_heads)
        self.num_kv_heads = self.kv_range[1] - self.kv_range[0]
        self.num_heads = self.num_kv_heads * group
        self.q_range = (self.kv_range[0] * group, self.kv_range[1] * group)
        d = args.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.register_buffer("qkv_weight", None, persistent=False)

    def fuse(self) -> None:
        """Serve q/k/v from one [q; k; v] weight (one GEMM); the separate weights become views of it."""
        fused = torch.cat([self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data])
        self.qkv_weight = fused
        sizes = [self.q_proj.weight.shape[0], self.k_proj.weight.shape[0], self.v_proj.weight.shape[0]]
        for lin, part in zip((self.q_proj, self.k_proj, self.v_proj), fused.split(sizes), strict=True):
            lin.weight.data = part

    def qkv_proj_weight(self) -> torch.Tensor:
        """The [q; k; v] projection weight: the fused one, or the three joined (unprepared modules)."""
        if self.qkv_weight is not None:
            return self.qkv_weight
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

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
        """(rotated q [T, H, D], x + residual) of the normed input; writes this chunk's K/V into the cache."""
        kv = self.kv_write(rope, k_cache, v_cache, meta)
        return self.ops.norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv_weight=self.qkv_proj_weight(), kv=kv)

    def kv_write(self, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Metadata) -> KVWrite:
        """Where this step's K/V go in the layer's caches (`meta`'s slots), rotated by `rope`, in its head layout."""
        return KVWrite(
            *rope, slot_mapping=meta.slot_mapping, k_cache=k_cache, v_cache=v_cache,
            heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )  # fmt: skip

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Metadata) -> torch.Tensor:
        """Attend with rotated q [T, H, D] over the cache and project back (partial sum under TP)."""
        out = meta.attend(q, k_cache, v_cache, self.scale)
        return self.tp.all_reduce(self.ops.linear(out, self.o_proj.weight))


class MLP(nn.Module):
    """SwiGLU feed-forward with the intermediate dimension split over ranks."""

    ops: TorchOps = TORCH_OPS
    gate_up_weight: torch.Tensor | None

    def __init__(self, args: LlamaArgs, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.range = tp.shard_range(args.intermediate_size)
        inter = self.range[1] - self.range[0]
        self.gate_proj = nn.Linear(args.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, args.hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)

    def fuse(self) -> None:
        """Serve gate and up from one [gate; up] weight (one GEMM); the separate weights become views."""
        fused = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        self.gate_up_weight = fused
        self.gate_proj.weight.data, self.up_proj.weight.data = fused.chunk(2)

    def gate_up_proj_weight(self) -> torch.Tensor:
        """The [gate; up] projection weight: the fused one, or the two joined (unprepared modules)."""
        if self.gate_up_weight is not None:
            return self.gate_up_weight
        return torch.cat([self.gate_proj.weight, self.up_proj.weight])

    def down(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU's second half from the [gate | up] projections, summed over ranks; plus `residual` when
        given (in the same kernel where the ops allow)."""
        if residual is not None and self.tp.size > 1:
            return self.down(gate_up) + residual
        return self.tp.all_reduce(self.ops.swiglu_linear(gate_up, self.down_proj.weight, residual))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU, summed over ranks."""
        return self.down(F.linear(x, self.gate_up_proj_weight()))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, args: LlamaArgs, tp: TPContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, tp)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Metadata,
    ) -> torch.Tensor:
        """Residual attention then residual MLP."""
        return self.step(x, None, rope=rope, k_cache=k_cache, v_cache=v_cache, meta=meta, whole=True)[0]

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
        """The layer with its last residual add deferred: the hidden state is out + residual, where the
        caller passes (previous out, previous residual), or (x, None) for the first layer. Deferring lets
        the next layer fuse that add into its input norm. `whole`: the add is done here instead (in the
        down projection where the ops allow), returning (hidden state, None)."""
        ops = self.input_layernorm.ops
        pre, post, attn = self.input_layernorm, self.post_attention_layernorm, self.self_attn
        q, residual = attn.project(x, residual, norm=pre, rope=rope, k_cache=k_cache, v_cache=v_cache, meta=meta)
        a = attn(q, k_cache, v_cache, meta)
        gate_up, residual = ops.norm_linear(a, residual, post.weight, post.eps, weight=self.mlp.gate_up_proj_weight())
        if whole:
            return self.mlp.down(gate_up, residual), None
        return self.mlp.down(gate_up), residual


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary range; lookups outside the range contribute zero."""

    def __init__(self, vocab: int, dim: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.range = tp.shard_range(vocab)
        self.weight = nn.Parameter(torch.empty(self.range[1] - self.range[0], dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids [T] -> [T, dim]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        lo, hi = self.range
        inside = (ids >= lo) & (ids < hi)
        out = F.embedding((ids - lo).clamp(0, hi - lo - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class LlamaModel(nn.Module):
    """Decoder stack returning pre-final-norm hidden states; `logits` applies norm + lm_head."""

    ragged_capture: ClassVar[bool] = True  # a ragged step over fixed buffers reads its lengths on the device

    def __init__(self, args: LlamaArgs, tp: TPContext | None = None) -> None:
        super().__init__()
        self.args = args
        self.tp = tp or TPContext()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, self.tp)
        self.layers = nn.ModuleList(self.decoder_layer(args, self.tp, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.vocab_sizes = self.tp.shard_sizes(args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(self.vocab_sizes[self.tp.rank], args.hidden_size))
        self.rotary = self.rotary_for(args)
        self.kernel_choices = kernel_choices.KernelChoices()  # how its Triton kernels launch (the builder's choice)
        self.feature_layers: tuple[int, ...] = (args.num_hidden_layers - 1,)  # what the draft head reads
        self.normed_features = False  # the draft reads the final-normed hidden state (DeepSeek's MTP modules)

    def tie_weights(self) -> None:
        """Share the embedding as the lm_head again where the config ties them (moving a model off the
        meta device gives every module its own new parameters)."""
        if self.args.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight

    # ---- the architecture's parts, also used to build a draft head of the same family ----------------
    @classmethod
    def decoder_layer(cls, args: LlamaArgs, tp: TPContext, index: int) -> nn.Module:
        """Decoder layer `index` (indices past the stack are a draft head's layers)."""
        return DecoderLayer(args, tp)

    @classmethod
    def rotary_for(cls, args: LlamaArgs) -> Rotary:
        """The RoPE table of this architecture."""
        return Rotary(args.dim_per_head, args.rope_theta, args.max_position_embeddings, args.rope_scaling)

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
        """A paged cache of `num_layers` layers holding this rank's share of the KV heads."""
        lo, hi = (tp or TPContext()).kv_head_range(args.num_key_value_heads)
        heads = {"num_kv_heads": hi - lo, "head_dim": args.dim_per_head}
        return KVCache.allocate(num_layers, num_blocks, block_size, dtype=dtype, device=device, **heads)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, d]."""
        return self.embed_tokens(ids)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: Metadata) -> torch.Tensor:
        """Run every layer over the flattened batch; returns hidden states [T, d] before the final norm."""
        return self.forward_features(ids, positions, cache, meta)[0]

    def forward_features(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: Metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the draft's features [T, n*d]: the outputs of `feature_layers`, concatenated in
        that order (the hidden states themselves when that is only the last layer)."""
        with kernel_choices.in_force(self.kernel_choices):
            return self._forward_features(ids, positions, cache, meta)

    def _forward_features(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: Metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        rope = self.rotary.table(positions)
        residual = None
        taps: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            read = i == last or i in self.feature_layers  # outputs that are read whole
            step = cast(DecoderLayer, layer).step
            x, residual = step(
                x, residual, rope=rope, k_cache=cache.keys[i], v_cache=cache.values[i], meta=meta, whole=read
            )
            if read:
                taps[i] = x
        hidden = x
        if self.normed_features:
            return hidden, self.norm(hidden)
        if self.feature_layers == (last,):
            return hidden, hidden
        return hidden, torch.cat([taps[i] for i in self.feature_layers], dim=-1)

    def prepare_for_inference(self, ops: TorchOps = TORCH_OPS) -> LlamaModel:
        """Fuse q/k/v and gate/up weights and pick the layer ops; call once, after loading and `.to()`."""
        prepare_for_inference(self, ops)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and (vocab-gathered) lm_head, fp32 logits [N, vocab]."""
        local = F.linear(self.norm(hidden), self.lm_head_weight)
        return self.tp.all_gather_last(local, self.vocab_sizes).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row's logits [N], without materialising them where the ops allow."""
        if self.tp.size > 1:
            return self.logits(hidden).argmax(-1)
        with kernel_choices.in_force(self.kernel_choices):
            return self.norm.ops.norm_argmax(hidden, self.norm.weight, self.norm.eps, self.lm_head_weight)

    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> KVCache:
        """A paged cache sized for this rank's KV heads."""
        dtype = next(self.parameters()).dtype
        return self.cache_for(
            self.args, len(self.layers), num_blocks, block_size, dtype=dtype, device=device, tp=self.tp
        )

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy full (unsharded) HF-named Llama weights into this rank's shard."""
        load_sharded(self, weights)


def prepare_for_inference(module: nn.Module, ops: TorchOps = TORCH_OPS) -> None:
    """Fuse the projections of every layer under `module` and set their layer ops (not for training:
    the fused weights do not carry gradients to the separate ones)."""
    for m in module.modules():
        if isinstance(m, Attention | MLP):
            m.fuse()
        if isinstance(m, RMSNorm | Attention | MLP):
            m.ops = ops


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi]


def load_sharded(model: LlamaModel, weights: dict[str, torch.Tensor]) -> None:
    """Slice HF-named full weights into `model`'s TP shard; raises KeyError naming a missing tensor."""
    hd = model.args.dim_per_head

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint has no tensor '{name}'")
        return weights[name]

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if param.shape != value.shape:
            raise ValueError(f"tensor '{name}': checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))

    lo, hi = model.embed_tokens.range
    put(
        model.embed_tokens.weight,
        _rows(take("model.embed_tokens.weight"), lo, hi),
        "model.embed_tokens.weight",
    )
    if not model.args.tie_word_embeddings:
        name = "lm_head.weight"
        put(model.lm_head_weight, _rows(take(name), lo, hi), name)
    put(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        att, mlp = layer.self_attn, layer.mlp
        qs, qe = att.q_range[0] * hd, att.q_range[1] * hd
        ks, ke = att.kv_range[0] * hd, att.kv_range[1] * hd
        ms, me = mlp.range
        put(att.q_proj.weight, take(p + "self_attn.q_proj.weight")[qs:qe], p + "self_attn.q_proj.weight")
        put(att.k_proj.weight, take(p + "self_attn.k_proj.weight")[ks:ke], p + "self_attn.k_proj.weight")
        put(att.v_proj.weight, take(p + "self_attn.v_proj.weight")[ks:ke], p + "self_attn.v_proj.weight")
        put(att.o_proj.weight, take(p + "self_attn.o_proj.weight")[:, qs:qe], p + "self_attn.o_proj.weight")
        put(mlp.gate_proj.weight, take(p + "mlp.gate_proj.weight")[ms:me], p + "mlp.gate_proj.weight")
        put(mlp.up_proj.weight, take(p + "mlp.up_proj.weight")[ms:me], p + "mlp.up_proj.weight")
        put(mlp.down_proj.weight, take(p + "mlp.down_proj.weight")[:, ms:me], p + "mlp.down_proj.weight")
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
        put(
            layer.post_attention_layernorm.weight,
            take(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm.weight",
        )


def random_llama_weights(args: LlamaArgs, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Full HF-named random weights for `args` (for tests and `--load-format dummy`)."""
    g = torch.Generator().manual_seed(seed)
    hd, d = args.dim_per_head, args.hidden_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(args.vocab_size, d)}
    if not args.tie_word_embeddings:
        w["lm_head.weight"] = rnd(args.vocab_size, d)
    w["model.norm.weight"] = 1.0 + rnd(d)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(args.num_attention_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = rnd(args.num_key_value_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = rnd(args.num_key_value_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = rnd(d, args.num_attention_heads * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(args.intermediate_size, d)
        w[p + "mlp.up_proj.weight"] = rnd(args.intermediate_size, d)
        w[p + "mlp.down_proj.weight"] = rnd(d, args.intermediate_size)
        w[p + "input_layernorm.weight"] = 1.0 + rnd(d)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rnd(d)
    return w
