"""Weight dtypes by name, without torch: what a config's dtype means on a device."""

from __future__ import annotations


def dtype_name(name: str, device: str) -> str:
    """The dtype `name` stands for on `device` ("auto": bfloat16 on CUDA, float32 elsewhere)."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return name
