"""The MTP Eagle draft head (DeepSeek-V3 MTP layout), sharing the target's embedding and output head.

Safetensors tensor names (all under the `mtp.` prefix):
- mtp.enorm.weight [d], mtp.hnorm.weight [d]             RMSNorm of the embedding and of the hidden state
- mtp.eh_proj.weight [d, 2d]                             projection of concat(enorm(e), hnorm(h))
- mtp.layer.<HF Llama decoder-layer names>              the decoder layer, e.g.
  mtp.layer.self_attn.q_proj.weight, mtp.layer.mlp.down_proj.weight, mtp.layer.input_layernorm.weight
- mtp.extra_layers.<j>.<decoder-layer names>             only for a deeper head: decoder layers run after
                                                         `layer`, each with its own draft KV cache layer
- mtp.fc.weight [d, n*d]                                 only with n > 1 feature layers (EAGLE-3 style fusion)
- mtp.vocab_ids [V'] int64                               only with a reduced draft vocabulary
- mtp.final_norm.weight [d]                              only for a head with its own output norm (DeepSeek's
                                                         shared_head.norm); otherwise the target's is used
The decoder layer's MLP may be wider than the target's (its width is read from mtp.layer.mlp.gate_proj.weight).
Metadata `feature_layers` ("2,15,29") names the target layers whose outputs the first draft step reads;
absent, the head reads the last layer's output (the target's pre-final-norm hidden state).
The embedding and lm_head (and, by default, the final norm) are the target's and are not stored. The
decoder layer is of the target's family (a Llama layer, or an MLA + MoE layer for DeepSeek-V3).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.draft_kernels import DraftInputWeights
from mtpserve.modeling.families import model_class
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaArgs, LlamaModel, RMSNorm, Rope
from mtpserve.modeling.parallel import TPContext
from mtpserve.speculative.draft_head import DraftHead

PREFIX = "mtp."
FEATURE_LAYERS_KEY = "feature_layers"
MAX_LAYERS = 4  # decoder layers of one head


def default_feature_layers(args: LlamaArgs) -> tuple[int, ...]:
    """The plain MTP input: the output of the target's last layer."""
    return (args.num_hidden_layers - 1,)


def fused_feature_layers(args: LlamaArgs) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high choice: the outputs of layers 2, L/2 and L-1 (0-based)."""
    n = args.num_hidden_layers
    return tuple(sorted({min(2, n - 1), n // 2, n - 1}))


class MTPEagleHead(DraftHead):
    """enorm(embed(token)) ++ hnorm(fc(features) or hidden) -> eh_proj -> decoder layer(s) -> hidden for the
    shared head, whose lm_head may be restricted to `vocab_ids` (a reduced draft vocabulary)."""

    vocab_ids: torch.Tensor | None

    def __init__(
        self,
        args: LlamaArgs,
        feature_layers: Sequence[int] | None = None,
        vocab_ids: torch.Tensor | None = None,
        own_norm: bool = False,
        mlp_size: int | None = None,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        d = args.hidden_size
        self.args = args
        if mlp_size is not None and mlp_size < 1:
            raise ValueError(f"mlp_size must be >= 1, got {mlp_size}")
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be in [1, {MAX_LAYERS}], got {num_layers}")
        self.mlp_size = mlp_size or args.intermediate_size
        layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(args)
        check_feature_layers(layers, args)
        self.feature_layers = layers
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.fc = nn.Linear(len(layers) * d, d, bias=False) if len(layers) > 1 else None
        family = model_class(args)
        layer_args = dataclasses.replace(args, intermediate_size=self.mlp_size)
        self.layer = family.decoder_layer(layer_args, TPContext(), args.num_hidden_layers)
        self.extra_layers = nn.ModuleList(
            family.decoder_layer(layer_args, TPContext(), args.num_hidden_layers + j) for j in range(1, num_layers)
        )
        self.rotary = family.rotary_for(args)
        self.final_norm = RMSNorm(d, args.rms_norm_eps) if own_norm else None
        self.normed_input = False  # whether the target's features are its final-normed hidden states
        if vocab_ids is not None:
            check_vocab_ids(vocab_ids, args.vocab_size)
            self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())
        else:
            self.vocab_ids = None
        self._lm_rows: torch.Tensor | None = None  # lm_head rows of vocab_ids, set by `bind`
        self._lm_rows_of: tuple[int, torch.dtype, torch.device] | None = None

    # ---- layout --------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's weights (what its inputs are cast to)."""
        return self.eh_proj.weight.dtype

    def layout(self) -> dict[str, Any]:
        """The constructor's keyword arguments that give a head of this shape (override some to change it)."""
        return {
            "feature_layers": self.feature_layers,
            "vocab_ids": self.vocab_ids,
            "own_norm": self.final_norm is not None,
            "mlp_size": self.mlp_size,
            "num_layers": self.num_layers,
        }

    @property
    def num_layers(self) -> int:
        """Decoder layers the head runs per draft step (each with its own draft KV cache layer)."""
        return 1 + len(self.extra_layers)

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers in the order they run."""
        return [self.layer, *self.extra_layers]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target features [.., n*d] through fc to [.., d]; a d-wide hidden state (a draft output) as is."""
        if self.fc is not None and hidden.shape[-1] == self.feature_size:
            return self.fc(hidden.to(self.fc.weight.dtype))
        return hidden

    # ---- forward -------------------------------------------------------------------------------------
    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: Metadata,
    ) -> torch.Tensor:
        """Draft hidden states [T, d] for rows reading (embedding of token i+1, hidden or features at i)."""
        return self._layer(self._input(embeds, hidden), self.rotary.table(positions), cache, meta)

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
        """`forward` for token ids [T], embedded with `shared`'s table (one kernel with the input norms and
        eh_proj where the ops allow). `rope` may hold the cos/sin rows of `positions`, computed ahead."""
        hidden = self.project(hidden)
        if shared.tp.size > 1:
            x = self._input(shared.embed(tokens), hidden)
        else:
            e = self.enorm
            weights = DraftInputWeights(
                shared.embed_tokens.weight, e.weight, self.hnorm.weight, e.eps, eh_proj=self.eh_proj.weight
            )
            x = e.ops.draft_input(tokens, hidden, weights)
        return self._layer(x, self.rotary.table(positions) if rope is None else rope, cache, meta)

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.project(hidden).to(embeds.dtype)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h)], dim=-1))

    def _layer(self, x: torch.Tensor, rope: Rope, cache: KVCache, meta: Metadata) -> torch.Tensor:
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, rope, k_cache=cache.keys[i], v_cache=cache.values[i], meta=meta)
        return x

    # ---- output head ---------------------------------------------------------------------------------
    def bind(self, shared: LlamaModel) -> None:
        """Gather the lm_head rows of the draft vocabulary from `shared` (once, before CUDA-graph capture)."""
        if self.vocab_ids is None or shared.tp.size > 1:
            return
        w = shared.lm_head_weight
        key = (w.data_ptr(), w.dtype, w.device)
        if self._lm_rows_of != key:
            self._lm_rows = w.detach().index_select(0, self.vocab_ids.to(w.device)).contiguous()
            self._lm_rows_of = key

    def logits(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V'] over the draft vocabulary (differentiable through `hidden`)."""
        if self.final_norm is not None:
            full = shared.tp.all_gather_last(
                F.linear(self.final_norm(hidden), shared.lm_head_weight), shared.vocab_sizes
            )
            return (full if self.vocab_ids is None else full[:, self.vocab_ids]).float()
        if self.vocab_ids is None:
            return shared.logits(hidden)
        if shared.tp.size > 1:
            return shared.logits(hidden)[:, self.vocab_ids]
        self.bind(shared)
        assert self._lm_rows is not None
        return F.linear(shared.norm(hidden), self._lm_rows).float()

    def _greedy_tokens(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax token per row [N], as target token ids."""
        if self.final_norm is not None:
            if shared.tp.size > 1 or self.vocab_ids is not None:
                return self.token_ids(self.logits(shared, hidden).argmax(-1))
            n = self.final_norm
            return n.ops.norm_argmax(hidden, n.weight, n.eps, shared.lm_head_weight)
        if self.vocab_ids is None:
            return shared.greedy_tokens(hidden)
        if shared.tp.size > 1:
            return self.token_ids(self.logits(shared, hidden).argmax(-1))
        self.bind(shared)
        assert self._lm_rows is not None
        n = shared.norm
        return self.token_ids(n.ops.norm_argmax(hidden, n.weight, n.eps, self._lm_rows))

    # ---- set-up --------------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> KVCache:
        """The draft's own paged KV cache, one layer per decoder layer."""
        return model_class(self.args).cache_for(
            self.args, self.num_layers, num_blocks, block_size, dtype=self.dtype, device=device
        )

    def init_from_target(self, target_weights: dict[str, torch.Tensor], layer: int | None = None) -> None:
        """Copy the target's last (or given) decoder layer into the head; eh_proj starts as [0.1 I | I] and fc
        passes the last feature layer through. Extra layers start as that layer with no effect on the output."""
        idx = self.args.num_hidden_layers - 1 if layer is None else layer
        prefix = f"model.layers.{idx}."
        sd = {k[len(prefix) :]: v for k, v in target_weights.items() if k.startswith(prefix)}
        load_widened(self.layer, sd)
        for extra in self.extra_layers:
            start_as_identity(extra, sd)
        d = self.args.hidden_size
        with torch.no_grad():
            self.enorm.weight.fill_(1.0)
            self.hnorm.weight.fill_(1.0)
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, d:] = torch.eye(d)
            self.eh_proj.weight[:, :d] = torch.eye(d) * 0.1
            if self.fc is not None:
                self.fc.weight.zero_()
                self.fc.weight[:, -d:] = torch.eye(d)

    def init_from_head(self, other: DraftHead) -> None:
        """Start from another head's weights (a trained head to continue). This head may have a wider MLP or
        more decoder layers; the extra units and layers start with no effect on the output (an extra layer as
        a copy of `other`'s last one with zero output projections)."""
        if not isinstance(other, MTPEagleHead):
            raise ValueError(f"cannot start an MTP Eagle head from a {type(other).__name__}")
        same = (
            other.feature_layers == self.feature_layers
            and (other.final_norm is None) == (self.final_norm is None)
            and other.draft_vocab_size == self.draft_vocab_size
        )
        if not same or other.mlp_size > self.mlp_size or other.num_layers > self.num_layers:
            raise ValueError(
                f"cannot start from a head with feature layers {list(other.feature_layers)}, draft vocabulary "
                f"{other.draft_vocab_size}, MLP {other.mlp_size} and {other.num_layers} layer(s): this one has "
                f"{list(self.feature_layers)}, {self.draft_vocab_size}, {self.mlp_size} and {self.num_layers}"
            )
        for layer, src in zip(self.decoder_layers, other.decoder_layers, strict=False):
            load_widened(layer, src.state_dict())
        for layer in self.decoder_layers[other.num_layers :]:
            start_as_identity(layer, other.decoder_layers[-1].state_dict())
        mine = self.state_dict()
        with torch.no_grad():
            for name, t in other.state_dict().items():
                if not name.startswith(("layer.", "extra_layers.")):
                    mine[name].copy_(t.to(mine[name].dtype))

    # ---- files ---------------------------------------------------------------------------------------
    def save(
        self, path: str | Path, metadata: dict[str, str] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        """Write the head as safetensors under the `mtp.` prefix (floating tensors in `dtype`)."""
        tensors = {}
        for k, v in self.state_dict().items():
            v = v.detach().cpu()
            tensors[PREFIX + k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
        meta = dict(metadata or {})
        meta[FEATURE_LAYERS_KEY] = ",".join(str(i) for i in self.feature_layers)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, args: LlamaArgs) -> MTPEagleHead:
        """Read a head saved by `save`; shapes must match the target's architecture."""
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k[len(PREFIX) :]: f.get_tensor(k) for k in f.keys() if k.startswith(PREFIX)}  # noqa: SIM118
        layers = parse_feature_layers(meta.get(FEATURE_LAYERS_KEY)) or default_feature_layers(args)
        gate = sd.get("layer.mlp.gate_proj.weight")
        mlp = int(gate.shape[0]) if gate is not None else None
        extra = {int(k.split(".")[1]) for k in sd if k.startswith("extra_layers.")}
        if extra != set(range(len(extra))):
            raise ValueError(f"{path}: extra draft layers must be numbered 0..n-1, got {sorted(extra)}")
        own_norm = "final_norm.weight" in sd
        head = cls(args, layers, sd.get("vocab_ids"), own_norm=own_norm, mlp_size=mlp, num_layers=1 + len(extra))
        floats = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
        missing, unexpected = head.load_state_dict(floats, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: draft head tensors missing {missing[:3]} / unexpected {unexpected[:3]}")
        return head


def start_as_identity(layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a decoder layer's `state` into `layer`, then zero its attention and MLP output projections: the
    residual layer passes its input through unchanged, and its other weights give those projections a
    gradient from the first step."""
    load_widened(layer, state)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()


def load_widened(module: nn.Module, state: dict[str, torch.Tensor], std: float = 0.02, seed: int = 0) -> None:
    """Load `state` into `module`, whose MLP may be wider: the extra gate/up rows start random (std) and the
    extra down_proj columns zero, so the module computes what `state` did and the extra units still learn."""
    own = module.state_dict()
    if set(own) != set(state):
        raise ValueError(f"tensor names differ: {sorted(set(own) ^ set(state))[:3]}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, dst in own.items():
            src = state[name].to(dst.dtype)
            if src.shape == dst.shape:
                dst.copy_(src)
            elif (
                name.endswith(("gate_proj.weight", "up_proj.weight"))
                and src.shape[1:] == dst.shape[1:]
                and src.shape[0] < dst.shape[0]
            ):
                n = src.shape[0]
                dst[:n] = src
                dst[n:] = torch.randn(dst[n:].shape, generator=g).to(dst.dtype) * std
            elif name.endswith("down_proj.weight") and src.shape[0] == dst.shape[0] and src.shape[1] < dst.shape[1]:
                n = src.shape[1]
                dst[:, :n] = src
                dst[:, n:] = 0.0
            else:
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")


def parse_feature_layers(text: str | None) -> tuple[int, ...]:
    """'2,15,29' -> (2, 15, 29); '' or None -> ()."""
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.replace("/", ",").split(",") if x.strip())
    except ValueError:
        raise ValueError(f"feature layers must be comma-separated integers, got {text!r}") from None


def check_feature_layers(layers: tuple[int, ...], args: LlamaArgs) -> None:
    """Raise ValueError unless `layers` are distinct, ascending, within the target and end at its last layer."""
    n = args.num_hidden_layers
    if not layers:
        raise ValueError("a draft head needs at least one feature layer")
    if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] != n - 1:
        raise ValueError(
            f"feature layers must be distinct, ascending, in [0, {n - 1}] and end with the last layer {n - 1}; "
            f"got {list(layers)}"
        )


def check_vocab_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless `ids` is a 1-D list of distinct token ids of the target."""
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"vocab_ids must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"vocab_ids must be distinct token ids in [0, {vocab_size})")


def head_layout(path: str | Path) -> tuple[int, ...]:
    """The feature layers a saved head reads (without loading its tensors); () for the default."""
    with safe_open(str(path), framework="pt") as f:
        return parse_feature_layers((f.metadata() or {}).get(FEATURE_LAYERS_KEY))


def describe(head: MTPEagleHead) -> str:
    """A one-line summary: feature layers, draft vocabulary, MLP width and decoder layers."""
    return json.dumps(
        {
            "feature_layers": list(head.feature_layers),
            "draft_vocab": head.draft_vocab_size,
            "mlp": head.mlp_size,
            "layers": head.num_layers,
        }
    )
