"""What a draft head offers the chains, trees and captured steps, whatever its layout.

A head reads, at row i, the token at i+1 and the target's features at i (the outputs of its `feature_layers`,
concatenated), or at a chained step its own output at the previous position; it writes its own paged KV
and returns its output hidden state, from which `logits` / `greedy_tokens` read the next draft token. The
MTP Eagle head (`mtp_head.py`) and the EAGLE-3 head (`eagle3_head.py`) are the two layouts.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from pathlib import Path

import torch
from torch import nn

from mtpserve.modeling import kernel_choices
from mtpserve.modeling.attention import Metadata
from mtpserve.modeling.kv_cache import KVCache
from mtpserve.modeling.model import LlamaArgs, LlamaModel, Rope, Rotary


class DraftHead(nn.Module, metaclass=ABCMeta):
    """A draft head of any layout. `args` are the target's hyper-parameters; `vocab_ids` maps the rows of a
    reduced draft vocabulary to target token ids (None: the draft's vocabulary is the target's)."""

    args: LlamaArgs
    feature_layers: tuple[int, ...]
    normed_input: bool  # whether the target's features are its final-normed hidden states
    rotary: Rotary
    vocab_ids: torch.Tensor | None
    mlp_size: int  # width of the decoder layers' MLP

    @property
    def feature_size(self) -> int:
        """Width of the target features the first draft step reads (d per feature layer)."""
        return self.args.hidden_size * len(self.feature_layers)

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Decoder layers the head runs per draft step (each with its own draft KV cache layer)."""

    @property
    def draft_vocab_size(self) -> int:
        """Rows of the draft's lm_head: the reduced vocabulary's size, or the target's."""
        return self.args.vocab_size if self.vocab_ids is None else int(self.vocab_ids.numel())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's weights (what its inputs are cast to)."""
        return next(self.parameters()).dtype

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
        """Draft hidden states [T, d] for token ids [T] (row i: the token at i+1) and target features [T, n*d]
        or the head's own outputs [T, d]; `shared` is the target (its embedding, and maybe its output head),
        whose kernel choices hold meanwhile. `rope` may hold the cos/sin rows of `positions`, computed ahead."""
        with kernel_choices.in_force(shared.kernel_choices):
            return self._step(shared, tokens, hidden=hidden, positions=positions, cache=cache, meta=meta, rope=rope)

    @abstractmethod
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
        """`step` itself, in its layout."""

    @abstractmethod
    def logits(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V'] over the draft vocabulary (differentiable through `hidden`)."""

    def greedy_tokens(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax token per row [N], as target token ids (under `shared`'s kernel choices)."""
        with kernel_choices.in_force(shared.kernel_choices):
            return self._greedy_tokens(shared, hidden)

    def _greedy_tokens(self, shared: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """`greedy_tokens` itself: the argmax of the logits, unless a layout has a faster way."""
        return self.token_ids(self.logits(shared, hidden).argmax(-1))

    def top_logprobs(self, shared: LlamaModel, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely draft-vocabulary indices of each row [N, k] and their log-probabilities (fp32),
        best first."""
        return shared.norm.ops.top_logprobs(self.logits(shared, hidden), k)

    def token_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return draft_index if self.vocab_ids is None else self.vocab_ids[draft_index]

    def bind(self, shared: LlamaModel) -> None:
        """Prepare anything read from `shared` once, before CUDA-graph capture."""

    @abstractmethod
    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> KVCache:
        """The draft's own paged KV cache, one layer per decoder layer."""

    @abstractmethod
    def save(
        self, path: str | Path, metadata: dict[str, str] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        """Write the head in its file format (floating tensors in `dtype`)."""

    @abstractmethod
    def init_from_target(self, target_weights: dict[str, torch.Tensor], layer: int | None = None) -> None:
        """Start training from the target's weights (its last, or the given, decoder layer)."""

    @abstractmethod
    def init_from_head(self, other: DraftHead) -> None:
        """Start from another head's weights (a trained head to continue); ValueError when it does not fit."""

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random initialisation (tests, or an explicit untrained head): norms 1, other weights normal."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
