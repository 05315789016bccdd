"""The import contracts in pyproject.toml hold on the tree, and break on an upward import or a circle.

Each check runs `lint-imports` on a copy of the packages, so the real tree is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "speculative", "modeling", "proto", "deploy")
MAX_LINES = 500
LAYERS = "Layers: cluster > workers > speculative > modeling > proto"
FLOORS = "Cluster floors: cli > bench | distributed > service > engine"
ENGINE_CORE = "The engine core imports no Ray, gRPC, HTTP or metrics library"
NO_CYCLES = "No import cycles between the modules of one package"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports with `root` as the working directory (its packages shadow any installed ones)."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.is_file() else [shutil.which("lint-imports") or "lint-imports"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([*cmd, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of pyproject.toml, the packages' Python files and the `mtpserve` package that links them."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    shutil.copytree(ROOT / "mtpserve", tmp_path / "mtpserve", symlinks=True)  # links to the copies above
    return tmp_path


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + line + "\n")


def test_contracts_hold(tree: Path) -> None:
    res = lint_imports(tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_upward_import_fails(tree: Path) -> None:
    add_line(
        tree / "speculative" / "verify.py",
        "from mtpserve.cluster.engine import llm_engine  # upward: the algorithm reaching the cluster",
    )
    res = lint_imports(tree)
    assert res.returncode != 0
    assert f"{LAYERS} BROKEN" in res.stdout
    assert "mtpserve.speculative is not allowed to import mtpserve.cluster" in res.stdout
    assert "mtpserve.speculative.verify -> mtpserve.cluster.engine.llm_engine" in res.stdout


def test_model_layer_cannot_import_runtimes(tree: Path) -> None:
    add_line(tree / "modeling" / "kv_cache.py", "import mtpserve.workers.runner")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "mtpserve.modeling is not allowed to import mtpserve.workers" in res.stdout


def test_proto_imports_no_project_package(tree: Path) -> None:
    add_line(tree / "proto" / "codec.py", "import mtpserve.speculative.messages")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "mtpserve.proto is not allowed to import mtpserve.speculative" in res.stdout


def test_circle_between_two_modules_fails(tree: Path) -> None:
    add_line(tree / "cluster" / "service" / "client.py", "import mtpserve.cluster.cli.cmd_generate")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert f"{NO_CYCLES} BROKEN" in res.stdout


def test_service_never_imports_deploy(tree: Path) -> None:
    add_line(tree / "cluster" / "cli" / "mtpserve.py", "import mtpserve.deploy.render")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "The service does not import deploy BROKEN" in res.stdout


def test_engine_core_cannot_import_the_service(tree: Path) -> None:
    add_line(tree / "cluster" / "engine" / "scheduler.py", "from mtpserve.cluster.service import metrics")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert f"{FLOORS} BROKEN" in res.stdout
    assert "mtpserve.cluster.engine is not allowed to import mtpserve.cluster.service" in res.stdout
    assert "mtpserve.cluster.engine.scheduler -> mtpserve.cluster.service.metrics" in res.stdout


def test_engine_core_cannot_import_the_ray_actors(tree: Path) -> None:
    add_line(tree / "cluster" / "engine" / "llm_engine.py", "import mtpserve.cluster.distributed.actors")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "mtpserve.cluster.engine is not allowed to import mtpserve.cluster.distributed" in res.stdout


def test_service_cannot_import_the_ray_actors(tree: Path) -> None:
    add_line(tree / "cluster" / "service" / "server.py", "from mtpserve.cluster.distributed import build")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "mtpserve.cluster.service is not allowed to import mtpserve.cluster.distributed" in res.stdout


def test_benchmarks_and_ray_actors_stay_apart(tree: Path) -> None:
    add_line(tree / "cluster" / "bench" / "trees.py", "import mtpserve.cluster.distributed.build")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert f"{FLOORS} BROKEN" in res.stdout
    assert "mtpserve.cluster.bench is not allowed to import mtpserve.cluster.distributed" in res.stdout


def test_engine_core_imports_no_ray_library(tree: Path) -> None:
    add_line(tree / "cluster" / "engine" / "block_manager.py", "import ray")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert f"{ENGINE_CORE} BROKEN" in res.stdout
    assert "mtpserve.cluster.engine.block_manager -> ray" in res.stdout


def test_front_ends_cannot_import_torch(tree: Path) -> None:
    add_line(tree / "cluster" / "service" / "stop_strings.py", "import mtpserve.speculative.logits_processing")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "Front ends and their pool import no torch BROKEN" in res.stdout
    assert "mtpserve.speculative.logits_processing -> torch" in res.stdout


def test_no_source_file_over_limit() -> None:
    files = [
        p
        for top in (*PACKAGES, "tests", "bench")
        for p in (ROOT / top).rglob("*.py")
        if "_pb2" not in p.name and "__pycache__" not in p.parts
    ]
    too_long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert files and not too_long, f"files over {MAX_LINES} lines: {too_long}"


def test_served_path_cannot_import_replayed_acceptance(tree: Path) -> None:
    add_line(tree / "workers" / "runner.py", "from mtpserve.speculative.replay import ReplayAcceptance")
    res = lint_imports(tree)
    assert res.returncode != 0
    assert "The served path never imports replayed (forced) acceptance BROKEN" in res.stdout
