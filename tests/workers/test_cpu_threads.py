"""On the CPU the model's process runs model.cpu_threads torch threads (half the cores by default), not torch's
default of one per core beside the front ends and tokenizers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from mtpserve.workers.config import ModelConfig, cpu_threads
from tests.helpers.service import ROOT, ServeProcess, child_env, write_dummy_model

SET_AND_PRINT = """
import sys, torch
from mtpserve.workers.builders import set_cpu_threads
from mtpserve.workers.config import MTPServeConfig
model = {"device": sys.argv[1]} | ({"cpu_threads": int(sys.argv[2])} if sys.argv[2] else {})
cfg = MTPServeConfig.from_dict({"model": model})
print(set_cpu_threads(cfg), torch.get_num_threads())
"""


def threads_set(device: str, configured: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SET_AND_PRINT, device, configured],
        cwd=ROOT,
        env=child_env(OMP_NUM_THREADS="7"),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.split()


def test_the_default_is_half_the_cores() -> None:
    assert cpu_threads(ModelConfig()) == max(1, (os.cpu_count() or 1) // 2)
    assert cpu_threads(ModelConfig(cpu_threads=3)) == 3


def test_the_setting_reaches_torch() -> None:
    assert threads_set("cpu", "3") == ["3", "3"]
    half = str(max(1, (os.cpu_count() or 1) // 2))
    assert threads_set("cpu", "") == [half, half]


def test_serve_runs_the_engine_process_with_the_setting(tmp_path: Path) -> None:
    model = write_dummy_model(tmp_path)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"model": {"load_format": "dummy", "cpu_threads": 1}}))
    args = ["--config", str(tmp_path / "serve.yaml"), "--model", str(model), "--device", "cpu", "--draft", "random"]
    with ServeProcess(args) as srv:
        assert "the model runs on the CPU with 1 torch threads" in srv.log
