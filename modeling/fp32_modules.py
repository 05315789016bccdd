"""Modules that keep fp32 parameters whatever dtype their model is cast to (`KeptInFp32`), and the cast that
honours them (`cast_keeping_fp32`)."""

from __future__ import annotations

import torch
from torch import nn


class KeptInFp32:
    """Marks a module whose own parameters and buffers stay fp32 whatever dtype the model is cast to."""


def cast_keeping_fp32(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """`module.to(device, dtype)`, except that `KeptInFp32` submodules (expert routers, whose scores pick
    experts by small margins) keep their fp32 values."""
    keep = {
        m: [(n, t.detach().clone()) for n, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]
        for m in module.modules()
        if isinstance(m, KeptInFp32)
    }
    module.to(device=device, dtype=dtype)
    for m, saved in keep.items():
        tensors = dict((*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)))
        for name, value in saved:
            tensors[name].data = value.to(device=device, dtype=torch.float32)
    return module
