"""torch.distributed set-up for a tensor-parallel group: NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from mtpserve.modeling.parallel import TPContext


def free_port() -> int:
    """An unused TCP port on this host."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_tp_group(rank: int, world: int, master: str, device: str, timeout_s: float = 60.0) -> TPContext:
    """Join (or re-join after a restart) the TP process group; returns this rank's context."""
    if world == 1:
        return TPContext()
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend, init_method=f"tcp://{master}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    return TPContext(rank=rank, size=world, group=dist.group.WORLD)
