"""Compile Triton kernels for an H200 (sm_90) without a GPU and print their SASS opcodes as JSON.

Usage: python tests/helpers/sass_dump.py '{"name": ["module:function", {constexprs}]}' (modules under modeling/).
Argument types come from their names: *_ptr are pointers (bf16, except the int and fp32 buffers listed
below), eps and scale are fp32, the rest i32. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

POINTERS = {
    "slot_ptr": "*i64", "ids_ptr": "*i64", "out_ptr": "*i64", "bits_ptr": "*i32", "tables_ptr": "*i32",
    "lens_ptr": "*i32", "count_ptr": "*i32", "idx_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
    "part_ptr": "*fp32", "stat_ptr": "*fp32", "val_ptr": "*fp32",
}  # fmt: skip
FLOATS = {"eps", "scale"}


def opcodes(kernel: Any, constexprs: dict[str, Any]) -> list[str]:
    """SASS opcodes, in order, of `kernel` compiled for sm_90 with these constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTERS.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in text.splitlines():
        if "*/" in line and ";" in line:
            ins = line.split("*/", 1)[1].strip()
            if ins.startswith("@"):
                ins = ins.split(" ", 1)[1]
            ops.append(ins.split(" ")[0].split(".")[0])
    return ops


def main() -> int:
    """Print {name: opcodes} for the kernels named in argv[1]."""
    jobs = json.loads(sys.argv[1])
    result = {}
    for name, (target, constexprs) in jobs.items():
        module, fn = target.split(":")
        result[name] = opcodes(getattr(importlib.import_module(f"modeling.{module}"), fn), constexprs)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
