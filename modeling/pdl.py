"""Programmatic dependent launch (PDL) for the Triton kernels of small steps, on Hopper GPUs and newer.

A kernel launched with PDL may start while the kernel before it in the stream is still running. Each such
kernel first loads what its predecessor does not write (its weights; for uniform attention, the keys and
values cached before this step), then waits until its predecessor has finished and its writes are visible
(`wait_for_inputs`), and only then reads activations or writes anything. So a small step's chain of
kernels reads each weight while the previous kernel is still working, instead of paying a launch and a
memory round trip per kernel on the critical path.

Order is kept by induction: every PDL kernel waits for the whole previous grid before it writes, and that
grid waited for its own predecessor, so all earlier kernels are done too; when a kernel starts, everything
but its immediate predecessor has finished. Kernels without PDL (cuBLAS, torch) start after their
predecessor ends, as always. CUDA graphs keep the launch attribute.

The switch is each model's (`KernelChoices.pdl`, from `model.pdl`, in force while the model runs); on CPU,
under Triton's interpreter and before compute capability 9.0 it is always off. The matrix-vector and greedy-token
kernels use it in steps of at most `SMALL_STEP_ROWS` rows (`active`), and the matrix-vector kernels in the larger
steps a tiles table splits into row groups: other large steps run their projections through cuBLAS, which
never releases the next kernel early. Uniform attention and the RoPE kernel before
it use it up to `ATTENTION_STEP_ROWS` rows, so that in those larger steps too the attention reads its
cached keys while RoPE runs.
"""

from __future__ import annotations

import functools
import os

import torch

from mtpserve.modeling import kernel_choices

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

SMALL_STEP_ROWS = 4  # the matrix-vector kernels' row limit (GEMV_MAX_ROWS); larger steps use cuBLAS
# RoPE and uniform attention: up to 32 rows (batch 8 with K=3) PDL made steps 1-2% shorter on an H200; from
# 64 rows (batch 64) 1-5% longer, the early attention programs holding SMs that RoPE's later waves need
ATTENTION_STEP_ROWS = 32


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def active(t: torch.Tensor, max_rows: int = SMALL_STEP_ROWS) -> bool:
    """Whether a kernel over the activations t (rows first) launches with PDL: switched on, a step of at most
    `max_rows` rows, and a device that supports it."""
    return t.shape[0] <= max_rows and device_supports(t)


def device_supports(t: torch.Tensor) -> bool:
    """Whether PDL is switched on and t's device can use it: CUDA, compute capability >= 9.0, and not
    Triton's CPU interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not (kernel_choices.current().pdl and t.is_cuda and triton is not None) or interpreted:
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_args(on: bool) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: the PDL launch attribute when `on`, nothing otherwise."""
    return {"launch_pdl": True} if on else {}


if triton is not None:

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        # past this point the previous kernel's writes are visible; the next kernel may start loading
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
