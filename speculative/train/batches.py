"""Batches for training and evaluation: padding, the target hidden-state store, and the epoch order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.train.data import TokenDataset
from mtpserve.speculative.train.dense import target_features


@dataclass
class Batch:
    """Right-padded sequences with their target features (shapes: B sequences, L longest, U layers)."""

    ids: torch.Tensor  # [B, L] int64, padded with 0
    lengths: torch.Tensor  # [B] int64
    response_start: torch.Tensor  # [B] int64
    features: torch.Tensor  # [B, L, U, d] outputs of `layers` (padded rows are junk)
    layers: tuple[int, ...]  # the target layers in `features`, ascending; the last is the final layer
    sources: list[str]

    @property
    def hidden(self) -> torch.Tensor:
        """The target's pre-final-norm hidden states [B, L, d]."""
        return self.features[:, :, -1]

    def features_for(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The concatenated outputs of `layers` [B, L, n*d] (what a head with those feature layers reads)."""
        if layers == self.layers[-1:]:
            return self.hidden
        idx = [self.layers.index(i) for i in layers]
        return self.features[:, :, idx].flatten(2)


def pad_ids(seqs: list[torch.Tensor], device: torch.device | str, multiple: int = 1) -> torch.Tensor:
    """Stack 1-D id tensors into [B, L] right-padded with 0, L rounded up to a multiple of `multiple`."""
    width = max(int(s.numel()) for s in seqs)
    width = -(-width // multiple) * multiple
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
    return out.to(device)


def autocast_ctx(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast on CUDA; a no-op elsewhere or for fp32."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


class HiddenStore:
    """Target features per sequence (the outputs of `layers`), computed by the dense forward and kept on
    the device if `keep`.

    Keeping them costs tokens * U * d * bytes (SmolLM2, bf16: about 1.2 KB per token and layer) and saves
    the 30-layer target forward on every later visit of a sequence. On CUDA, batch widths are rounded up
    to a multiple of 64: every new width costs attention-plan and allocator set-up, which made the first
    few hundred steps of a run up to 10x slower than the rest.
    """

    def __init__(
        self,
        model: LlamaModel,
        data: TokenDataset,
        device: torch.device,
        keep: bool = True,
        max_batch_tokens: int = 32768,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.data = data
        self.device = device
        self.keep = keep
        self.max_batch_tokens = max_batch_tokens
        last = len(model.layers) - 1
        self.layers = tuple(sorted(set(layers or ()) | {last}))
        self.pad_multiple = 64 if device.type == "cuda" else 1
        self._cache: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def _compute(self, indices: list[int]) -> list[torch.Tensor]:
        ids = pad_ids([self.data.ids[i] for i in indices], self.device, self.pad_multiple)
        h = target_features(self.model, ids, self.layers)
        return [h[r, : self.data.ids[i].numel()] for r, i in enumerate(indices)]

    def _chunks(self, indices: list[int]) -> Iterator[list[int]]:
        order = sorted(indices, key=lambda i: self.data.ids[i].numel())
        chunk: list[int] = []
        for i in order:
            width = self.data.ids[i].numel()  # ascending order: the newest sequence is the longest
            if chunk and width * (len(chunk) + 1) > self.max_batch_tokens:
                yield chunk
                chunk = []
            chunk.append(i)
        if chunk:
            yield chunk

    def precompute(self, indices: list[int], desc: str = "target hidden states") -> None:
        """Fill the store for `indices` in length-sorted chunks (no-op unless keeping)."""
        if not self.keep:
            return
        todo = [i for i in indices if i not in self._cache]
        with tqdm(total=len(todo), desc=desc, unit="seq", disable=not todo) as bar:
            for chunk in self._chunks(todo):
                for i, h in zip(chunk, self._compute(chunk), strict=True):
                    self._cache[i] = h.clone()
                bar.update(len(chunk))

    def batch(self, indices: list[int]) -> Batch:
        """Padded ids and hidden states for `indices`."""
        seqs = [self.data.ids[i] for i in indices]
        ids = pad_ids(seqs, self.device, self.pad_multiple)
        if self.keep:
            missing = [i for i in indices if i not in self._cache]
            if missing:
                for i, h in zip(missing, self._compute(missing), strict=True):
                    self._cache[i] = h.clone()
            hs = [self._cache[i] for i in indices]
            feats = torch.zeros(len(indices), ids.shape[1], *hs[0].shape[1:], dtype=hs[0].dtype, device=self.device)
            for r, h in enumerate(hs):
                feats[r, : h.shape[0]] = h
        else:
            with torch.no_grad():
                feats = target_features(self.model, ids, self.layers)
        return Batch(
            ids=ids,
            lengths=torch.tensor([s.numel() for s in seqs], device=self.device),
            response_start=torch.tensor([self.data.response_start[i] for i in indices], device=self.device),
            features=feats,
            layers=self.layers,
            sources=[self.data.source[i] for i in indices],
        )


def epoch_batches(
    indices: list[int],
    lengths: list[int],
    batch_size: int,
    seed: int,
    epoch: int,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """A deterministic function of (seed, epoch): shuffle, sort within pools of 16 batches by length, cut
    into batches of at most `batch_size` sequences and `max_tokens` padded tokens, shuffle the batches.

    Sorting inside pools keeps padding low; the token cap keeps batches of long sequences from running out
    of memory; being a pure function makes `--resume` reproduce the order.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [indices[int(i)] for i in torch.randperm(len(indices), generator=g)]
    pool = batch_size * 16
    batches: list[list[int]] = []
    for lo in range(0, len(perm), pool):
        part = sorted(perm[lo : lo + pool], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in part:  # ascending: the newest sequence is the longest
            if batch and (len(batch) == batch_size or (max_tokens and lengths[i] * (len(batch) + 1) > max_tokens)):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    order = torch.randperm(len(batches), generator=g)
    return [batches[int(i)] for i in order]
