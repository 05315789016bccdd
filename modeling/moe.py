"""DeepSeek-V3 mixture of experts: sigmoid routing with group-limited top-k, routed experts run as one
grouped GEMM per projection, and shared experts; every expert's intermediate dimension is split over TP ranks.

The token-to-expert order is computed on the device with fixed shapes (argsort, a scatter count), so a
step with experts can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.modeling.deepseek_config import DeepseekV3Args
from mtpserve.modeling.fp32_modules import KeptInFp32
from mtpserve.modeling.layer_ops import TORCH_OPS, TorchOps
from mtpserve.modeling.model import MLP
from mtpserve.modeling.parallel import TPContext


class Router(KeptInFp32, nn.Module):
    """Sigmoid scores per expert; choice among the best `topk_group` groups with a load-balancing bias."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token's chosen experts."""
        a = self.args
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(a.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(a.n_routed_experts // a.n_group, dim=1), float("-inf"))
        ids = choice.topk(a.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, ids


class Experts(nn.Module):
    """Routed experts' SwiGLU weights stacked per expert: gate_up_proj [E, 2I, d], down_proj [E, d, I]
    (this rank's slice of I)."""

    ops: TorchOps = TORCH_OPS

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t; returns [T, d]."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        rows = x[token]
        gate_up = grouped_linear(rows, self.gate_up_proj, offsets, flat[order])
        down = grouped_linear(self.ops.silu_mul(gate_up), self.down_proj, offsets, flat[order])
        down = down * weights.reshape(-1)[order, None].to(down.dtype)
        return torch.zeros_like(x).index_add_(0, token, down)


def grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor
) -> torch.Tensor:
    """rows [N, in] sorted by expert, each times its expert's weight [E, out, in] transposed; `offsets` [E]
    are the groups' end rows, `expert` [N] each row's expert. Where torch's grouped GEMM does not take the
    operands, a per-expert loop serves instead; it reads expert ids on the host, so a step that needs it is
    not captured (the graph runner then runs it eagerly)."""
    if _grouped_mm_fits(rows, weight):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    for e in torch.unique(expert).tolist():
        sel = expert == e
        out[sel] = F.linear(rows[sel], weight[e])
    return out


def _grouped_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands (16-byte-aligned rows; bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    if rows.is_cuda and (rows.dtype != torch.bfloat16 or torch.cuda.get_device_capability(rows.device)[0] < 9):
        return False
    size = rows.element_size()
    return all((n * size) % 16 == 0 for n in (rows.shape[1], weight.shape[1], weight.shape[2]))


class MoE(nn.Module):
    """Routed experts plus the shared experts, summed over TP ranks once."""

    def __init__(self, args: DeepseekV3Args, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.range = tp.shard_range(args.moe_intermediate_size)
        inter = self.range[1] - self.range[0]
        self.gate = Router(args)
        self.experts = Experts(args.n_routed_experts, args.hidden_size, inter)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(_with_width(args, shared), tp) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token through its routed experts and the shared ones."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            s = self.shared_experts
            out = out + s.ops.swiglu_linear(F.linear(x, s.gate_up_proj_weight()), s.down_proj.weight)
        return self.tp.all_reduce(out)


def _with_width(args: DeepseekV3Args, inter: int) -> DeepseekV3Args:
    return replace(args, intermediate_size=inter)
