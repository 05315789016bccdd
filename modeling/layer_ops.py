"""The element-wise steps of a decoder layer, as one object per implementation.

`TorchOps` is the reference (any device). `TritonOps` runs each step as one fused kernel on CUDA. With
fused q/k/v and gate/up weights a layer takes 9 launches on large steps and 5 on small ones (up to
`TritonOps.small_rows` rows), where the norms and SwiGLU also fold into the projections that follow
them, RoPE and the KV write into the q/k/v projection, and every projection is a Triton matrix-vector
kernel. That matters because a small model's decode
step is bound by kernel count and memory latency, not by arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpserve.modeling import argmax_kernels, draft_kernels, fused_kernels, topk_kernels
from mtpserve.modeling.attention import write_kv
from mtpserve.modeling.draft_kernels import DraftInputWeights
from mtpserve.modeling.kv_cache import KVWrite


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim, computed in fp32 and returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] by fp32 cos/sin [T, 1, D]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class TorchOps:
    """Reference implementations in plain torch."""

    name = "torch"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        s = x if residual is None else x + residual
        return rms_norm(s, weight, eps), s

    def rope_write_kv(self, qkv: torch.Tensor, kv: KVWrite) -> torch.Tensor:
        """Rotate q, k of qkv [T, (H + 2 Hkv) * D]; write k, v to the caches; return q [T, H, D]."""
        t, heads, kv_heads, d = qkv.shape[0], kv.heads, kv.kv_heads, kv.head_dim
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        qk = torch.cat([q.reshape(t, heads, d), k.reshape(t, kv_heads, d)], 1)
        q, k = apply_rope(qk, kv.cos, kv.sin).split([heads, kv_heads], dim=1)
        write_kv(kv.k_cache, kv.slot_mapping, k)
        write_kv(kv.v_cache, kv.slot_mapping, v.reshape(t, kv_heads, d))
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] laid out as [gate | up]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) @ weight.T, x + residual): `add_rms_norm` followed by a projection."""
        h, s = self.add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(h, weight), s

    def swiglu_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """silu(gate) * up @ weight.T: `silu_mul` followed by the down projection; plus `residual` if given."""
        out = F.linear(self.silu_mul(gate_up), weight)
        return out if residual is None else out + residual

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T."""
        return F.linear(x, weight)

    def norm_qkv_rope(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        qkv_weight: torch.Tensor,
        kv: KVWrite,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated q [T, H, D], x + residual): `norm_linear` into [q; k; v], then `rope_write_kv`."""
        qkv, s = self.norm_linear(x, residual, norm_weight, eps, weight=qkv_weight)
        return self.rope_write_kv(qkv, kv), s

    def norm_argmax(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        """Greedy token per row [T]: argmax of norm(x) @ weight.T (the lm_head's logits)."""
        return F.linear(self.add_rms_norm(x, None, norm_weight, eps)[0], weight).argmax(-1)

    def top_logprobs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest log-softmax values of each row of logits [M, V] (fp32 [M, k]) and their indices."""
        x = logits.float()
        top, index = x.topk(k, dim=-1)
        return top - torch.logsumexp(x, dim=-1, keepdim=True), index

    def draft_input(self, tokens: torch.Tensor, hidden: torch.Tensor, w: DraftInputWeights) -> torch.Tensor:
        """The MTP head's input: cat(enorm(embed(tokens)), hnorm(hidden)) @ eh_proj.T."""
        e = self.add_rms_norm(F.embedding(tokens, w.embed), None, w.enorm, w.eps)[0]
        h = self.add_rms_norm(hidden.to(e.dtype), None, w.hnorm, w.eps)[0]
        return F.linear(torch.cat([e, h], dim=-1), w.eh_proj)


class TritonOps(TorchOps):
    """The same steps as fused Triton kernels (one launch each); steps the matrix-vector kernels take (at most
    `small_rows` rows, and `fused_kernels.gemv_fits`) also fold the norm or SwiGLU into the projection after it."""

    name = "triton"
    small_rows = fused_kernels.GEMV_ROWS_CAP  # 0 turns off the matrix-vector, greedy-token and MTP-input kernels

    def _small(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether rows x go through a matrix-vector kernel against `weight`."""
        return x.shape[0] <= self.small_rows and fused_kernels.gemv_takes(x, weight)

    add_rms_norm = staticmethod(fused_kernels.add_rms_norm)
    rope_write_kv = staticmethod(fused_kernels.rope_write_kv)
    silu_mul = staticmethod(fused_kernels.silu_mul)

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One matrix-vector kernel for small steps; add_rms_norm plus cuBLAS otherwise."""
        if not self._small(x, weight):
            return super().norm_linear(x, residual, norm_weight, eps, weight=weight)
        return fused_kernels.norm_linear(x, residual, norm_weight, eps, weight=weight)

    def swiglu_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One matrix-vector kernel for small steps (the residual add included); silu_mul plus cuBLAS
        otherwise."""
        if not self._small(gate_up, weight):
            return super().swiglu_linear(gate_up, weight, residual)
        return fused_kernels.swiglu_linear(gate_up, weight, residual)

    def norm_qkv_rope(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        qkv_weight: torch.Tensor,
        kv: KVWrite,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel for small steps (norm, q/k/v projection, RoPE, KV write); two otherwise."""
        if not (self._small(x, qkv_weight) and fused_kernels.rope_fits(x.shape[0], x.shape[1], kv.head_dim)):
            return super().norm_qkv_rope(x, residual, norm_weight, eps, qkv_weight=qkv_weight, kv=kv)
        return fused_kernels.norm_qkv_rope(x, residual, norm_weight, eps, weight=qkv_weight, kv=kv)

    def norm_argmax(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        """Two launches for up to 16 rows, without writing the logits; norm, cuBLAS and argmax otherwise."""
        if self.small_rows and argmax_kernels.norm_argmax_fits(x, weight):
            try:
                return argmax_kernels.norm_argmax(x, norm_weight, eps, weight)
            except argmax_kernels.TileDoesNotFit:
                pass
        return super().norm_argmax(x, norm_weight, eps, weight)

    def draft_input(self, tokens: torch.Tensor, hidden: torch.Tensor, w: DraftInputWeights) -> torch.Tensor:
        """One launch for small steps; five otherwise."""
        if tokens.shape[0] > self.small_rows or not draft_kernels.draft_input_fits(tokens, hidden, w):
            return super().draft_input(tokens, hidden, w)
        return draft_kernels.draft_input(tokens, hidden, w)

    def top_logprobs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two launches (ties to the lowest index) instead of torch's cast, top-k and logsumexp."""
        if not topk_kernels.top_logprobs_fits(logits, k):
            return super().top_logprobs(logits, k)
        return topk_kernels.top_logprobs(logits, k)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The matrix-vector kernel for small steps; cuBLAS otherwise."""
        if not self._small(x, weight):
            return F.linear(x, weight)
        return fused_kernels.linear(x, weight)


TORCH_OPS = TorchOps()


def pick_ops(device: str | torch.device, fused_kernels_enabled: bool = True) -> TorchOps:
    """Triton kernels on CUDA when enabled and available, else the torch reference."""
    if fused_kernels_enabled and torch.device(device).type == "cuda" and fused_kernels.available():
        return TritonOps()
    return TORCH_OPS
