"""Batches for training and evaluation: padding, the target hidden-state store, and the epoch order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from speculative.train.data import TokenDataset
from speculative.train.dense import target_hidden
from workers.model import LlamaModel


@dataclass
class Batch:
    """Right-padded sequences with their target hidden states (shapes: B sequences, L longest)."""

    ids: torch.Tensor  # [B, L] int64, padded with 0
    lengths: torch.Tensor  # [B] int64
    response_start: torch.Tensor  # [B] int64
    hidden: torch.Tensor  # [B, L, d] target pre-norm hidden states (padded rows are junk)
    sources: list[str]


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
    """Target hidden states per sequence, computed by the dense forward and kept on the device if `keep`.

    Keeping them costs tokens * d * bytes (SmolLM2, bf16: about 1.2 KB per token) and saves the 30-layer
    target forward on every later visit of a sequence. On CUDA, batch widths are rounded up to a multiple
    of 64: every new width costs attention-plan and allocator set-up, which made the first few hundred
    steps of a run up to 10x slower than the rest.
    """

    def __init__(
        self,
        model: LlamaModel,
        data: TokenDataset,
        device: torch.device,
        keep: bool = True,
        max_batch_tokens: int = 32768,
    ) -> None:
        self.model = model
        self.data = data
        self.device = device
        self.keep = keep
        self.max_batch_tokens = max_batch_tokens
        self.pad_multiple = 64 if device.type == "cuda" else 1
        self._cache: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def _compute(self, indices: list[int]) -> list[torch.Tensor]:
        ids = pad_ids([self.data.ids[i] for i in indices], self.device, self.pad_multiple)
        h = target_hidden(self.model, ids)
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
            hidden = torch.zeros(len(indices), ids.shape[1], hs[0].shape[-1], dtype=hs[0].dtype, device=self.device)
            for r, h in enumerate(hs):
                hidden[r, : h.shape[0]] = h
        else:
            with torch.no_grad():
                hidden = target_hidden(self.model, ids)
        return Batch(
            ids=ids,
            lengths=torch.tensor([s.numel() for s in seqs], device=self.device),
            response_start=torch.tensor([self.data.response_start[i] for i in indices], device=self.device),
            hidden=hidden,
            sources=[self.data.source[i] for i in indices],
        )


def epoch_batches(indices: list[int], lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """A deterministic function of (seed, epoch): shuffle, sort within pools of 16 batches by length, shuffle batches.

    Sorting inside pools keeps padding low; being a pure function makes `--resume` reproduce the order.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [indices[int(i)] for i in torch.randperm(len(indices), generator=g)]
    pool = batch_size * 16
    batches: list[list[int]] = []
    for lo in range(0, len(perm), pool):
        part = sorted(perm[lo : lo + pool], key=lambda i: lengths[i])
        batches += [part[j : j + batch_size] for j in range(0, len(part), batch_size)]
    order = torch.randperm(len(batches), generator=g)
    return [batches[int(i)] for i in order]
