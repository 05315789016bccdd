"""Tensors on the wire: {dtype, shape, raw little-endian bytes}, the KServe v2 convention."""

from __future__ import annotations

import sys

import torch

from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb

_TO_NAME = {
    torch.float32: "FP32",
    torch.bfloat16: "BF16",
    torch.float16: "FP16",
    torch.int64: "INT64",
    torch.int32: "INT32",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}
assert sys.byteorder == "little", "the tensor codec assumes a little-endian host"


def encode_tensor(t: torch.Tensor) -> wpb.Tensor:
    """Serialise a tensor (any device) into a Tensor message."""
    if t.dtype not in _TO_NAME:
        raise TypeError(f"dtype {t.dtype} has no wire name")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return wpb.Tensor(dtype=_TO_NAME[t.dtype], shape=list(t.shape), data=raw)


def decode_tensor(msg: wpb.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rebuild a tensor from a Tensor message; ValueError naming dtype, shape or data when it is malformed."""
    if msg.dtype not in _FROM_NAME:
        raise ValueError(f"tensor dtype: unknown name '{msg.dtype}'; expected one of {sorted(_FROM_NAME)}")
    dtype = _FROM_NAME[msg.dtype]
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape: {shape} has a negative dimension")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise ValueError(
            f"tensor data: shape {shape} and dtype {msg.dtype} need {numel * itemsize} bytes, got {len(msg.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    out = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)
    return out.to(device)


def tensor_nbytes(msg: wpb.Tensor) -> int:
    """Payload bytes of a Tensor message."""
    return len(msg.data)
