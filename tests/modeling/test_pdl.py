"""Programmatic dependent launch: the switch, and where the kernels wait, read off the machine code that
Triton's own compiler makes for an H200 (sm_90) on this CPU-only machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.modeling import fused_kernels, kernel_choices, pdl
from mtpserve.modeling.attention import ragged_metadata
from mtpserve.workers.config import MTPServeConfig

pytestmark = pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")

HOPPER = 90


def sass(kernels: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, list[str]]:
    """Opcodes of each named kernel ("module:function", constexprs) compiled for sm_90, in a subprocess
    that runs Triton's compiler rather than its interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "helpers" / "sass_dump.py"), json.dumps(kernels)],
        capture_output=True, text=True, env=env, check=False, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


GEMV = {"BLOCK_M": 4, "BLOCK_N": 8, "BLOCK_K": 1024}
ATTENTION = dict(Q_LEN=4, GROUP=3, ROWS=16, BLOCK=16, DIM=64, TILE=128, STAGES=2, MAX_SPLITS=16, SPLIT_TILES=2)
# name: (kernel, constexprs, whether it reads what its predecessor does not write before waiting: weights, or
# the attention's cached keys and values); SmolLM2-135M's shapes
KERNELS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "norm_linear": ("fused_kernels:_norm_linear", {"HAS_NORM": True, "HAS_RES": True, **GEMV}, True),
    "norm_qkv_rope": (
        "fused_kernels:_norm_qkv_rope",
        {"HAS_RES": True, "HEADS": 9, "KV_HEADS": 3, "DIM": 64, "HALF": 32, "PAIRS": 4, "BLOCK_M": 4, "BLOCK_K": 1024},
        True,
    ),
    "swiglu_linear": ("fused_kernels:_swiglu_linear", {**GEMV, "BLOCK_K": 2048}, True),
    "uniform_attention": (
        "triton_attention:_uniform_paged_attn",
        {**ATTENTION, "TREE": False, "EARLY": True},
        True,
    ),
    "rope_write_kv": ("fused_kernels:_rope_write_kv", {"HEADS": 9, "KV_HEADS": 3, "DIM": 64, "HALF": 32}, False),
    "norm_argmax": (
        "argmax_kernels:_norm_argmax_tiles",
        {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 64, "FULL_K": 1024, "STAGES": 3},
        True,
    ),
    "argmax_of_tiles": ("argmax_kernels:_argmax_of_tiles", {"BLOCK_T": 256}, False),
    "draft_input": ("draft_kernels:_draft_input", {"BLOCK_M": 4, "BLOCK_N": 8, "BLOCK_K": 1024}, True),
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[str]]:
    """Every kernel with PDL on, and swiglu_linear also with it off (as "swiglu_linear/off")."""
    jobs = {name: (fn, {**c, "PDL": True}) for name, (fn, c, _) in KERNELS.items()}
    fn, c, _ = KERNELS["swiglu_linear"]
    jobs["swiglu_linear/off"] = (fn, {**c, "PDL": False})
    return sass(jobs)


WAIT, RELEASE = "ACQBULK", "PREEXIT"  # griddepcontrol.wait and .launch_dependents in Hopper SASS
WRITES = ("STG", "ATOMG", "RED", "ATOM")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_waits_before_reading_activations_and_writing(name: str, compiled: dict[str, list[str]]) -> None:
    """With PDL each small-step kernel waits once, lets its successor start right after, writes nothing
    before the wait, and (the matrix-vector and attention kernels) issues its weight or cached K/V loads
    before it."""
    prefetches = KERNELS[name][2]
    ops = compiled[name]
    assert ops.count(WAIT) == 1 and ops.count(RELEASE) == 1, (name, ops.count(WAIT), ops.count(RELEASE))
    wait = ops.index(WAIT)
    assert ops.index(RELEASE) > wait
    before = ops[:wait]
    assert not [op for op in before if op in WRITES], f"{name} writes before waiting: {before}"
    loads_before = sum(op == "LDG" for op in before)
    if prefetches:
        assert loads_before >= 8, f"{name} reads only {loads_before} values before waiting"
        assert sum(op == "LDG" for op in ops[wait:]) >= 1  # its activations come after the wait
    else:
        assert loads_before == 0, f"{name} reads {loads_before} values before waiting for their writer"


def test_without_pdl_the_kernels_do_not_wait(compiled: dict[str, list[str]]) -> None:
    """PDL off compiles the same kernel without the wait or the early release."""
    ops = compiled["swiglu_linear/off"]
    assert WAIT not in ops and RELEASE not in ops and "STG" in ops


def test_pdl_is_off_on_cpu_and_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch alone never turns PDL on: it needs a CUDA tensor on a Hopper-class device, outside
    Triton's interpreter; launch_args adds the attribute only when on."""
    assert kernel_choices.current().pdl
    assert not pdl.active(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.active(torch.zeros(1))
    assert pdl.launch_args(True) == {"launch_pdl": True} and pdl.launch_args(False) == {}


def test_pdl_only_for_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a capable device, kernels over at most SMALL_STEP_ROWS rows launch with PDL and larger steps
    (whose projections run through cuBLAS) do not; RoPE and attention ask for up to ATTENTION_STEP_ROWS."""
    monkeypatch.setattr(pdl, "device_supports", lambda t: True)
    rows = pdl.SMALL_STEP_ROWS
    assert pdl.active(torch.zeros(1, 8)) and pdl.active(torch.zeros(rows, 3, 8))
    assert not pdl.active(torch.zeros(rows + 1, 8)) and not pdl.active(torch.zeros(64, 3, 8))
    wide = pdl.ATTENTION_STEP_ROWS  # RoPE and attention take it further, not to batch 64
    assert pdl.active(torch.zeros(wide, 3, 8), wide) and not pdl.active(torch.zeros(64, 3, 8), wide)


def test_model_pdl_flag_reaches_the_models_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--no-pdl` sets model.pdl false; a target built with it launches without PDL while one built by default
    launches with it, in the same process, and building either changes nothing outside their runs."""
    import argparse

    from mtpserve.workers.builders import build_target
    from tests.helpers.tiny import tiny_args, tiny_weights

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert config_from_args(p.parse_args(["--no-pdl"])).model.pdl is False
    assert config_from_args(p.parse_args([])).model.pdl is True
    assert MTPServeConfig().model.pdl is True

    args = tiny_args()
    off = build_target(args, tiny_weights(args), torch.float32, "cpu", pdl_launch=False)
    on = build_target(args, tiny_weights(args), torch.float32, "cpu")
    assert kernel_choices.current().pdl
    seen: list[bool] = []
    for model in (off, on):
        real = model.layers[0].step

        def spy(*a: Any, real: Any = real, **k: Any) -> Any:
            seen.append(kernel_choices.current().pdl)
            return real(*a, **k)

        monkeypatch.setattr(model.layers[0], "step", spy)
        cache = model.allocate_cache(4, 16, "cpu")
        model.forward(
            torch.tensor([1, 2, 3]), torch.arange(3), cache, ragged_metadata([0], [3], [[0]], 16, device="cpu")
        )
    assert seen == [False, True]
