"""The installed distribution is one import package, `mtpserve`, and leaves every other top-level module alone.

proto-plus (pulled in by `ray[default]`) owns the top-level `proto` package; a wheel that shipped the repository's
`proto/` folder as `proto` overwrote it, and uninstalling it deleted proto-plus's `__init__.py`.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("cluster", "workers", "speculative", "modeling", "proto")


def pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip; fail the test with its output when it fails."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from the checkout without build isolation (no downloads)."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "mtpserve-src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info"))
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src))
    (whl,) = out.glob("mtpserve-*.whl")
    return whl


def test_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    name, version = wheel.name.split("-")[:2]
    assert tops == {"mtpserve", f"{name}-{version}.dist-info"}, tops
    for sub in SUBPACKAGES:
        assert f"mtpserve/{sub}/__init__.py" in names, sub
    assert "mtpserve/proto/mtpserve/v1/inference_pb2.py" in names
    assert "mtpserve/speculative/heads/smollm2-135m-mtp.safetensors" in names  # the default draft head
    assert not any(n.startswith(("mtpserve/tests/", "mtpserve/bench/")) for n in names)


@pytest.mark.slow
def test_install_beside_proto_plus_and_uninstall(wheel: Path, tmp_path: Path) -> None:
    """Install next to proto-plus in a fresh environment, import both, uninstall mtpserve: proto-plus still imports."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    for dist in map(importlib.metadata.distribution, ("proto-plus", "protobuf")):  # as installed here
        for f in dist.files or []:
            src = Path(str(dist.locate_file(f)))
            if src.is_file() and "__pycache__" not in f.parts:
                (site / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, site / f)

    probe = (
        "import importlib.util, proto, mtpserve; "
        "assert hasattr(proto, 'Message'), proto.__file__; "
        "assert importlib.util.find_spec('mtpserve.cluster.engine.scheduler') is not None; "
        "assert importlib.util.find_spec('mtpserve.proto.codec') is not None; "
        "assert importlib.util.find_spec('cluster') is None and importlib.util.find_spec('workers') is None; "
        "print(proto.__file__, mtpserve.__file__)"
    )
    pip("--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel))
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(site / "proto") in res.stdout and str(site / "mtpserve") in res.stdout

    pip("--python", str(py), "uninstall", "-y", "mtpserve")
    res = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util, proto; assert hasattr(proto, 'Message');"
            " assert importlib.util.find_spec('mtpserve') is None",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (site / "proto" / "__init__.py").is_file()


def test_package_links_name_the_top_level_folders() -> None:
    """mtpserve/ holds links to the repository's top-level folders, so `mtpserve.X` is the folder X."""
    for sub in (*SUBPACKAGES, "deploy"):
        link = ROOT / "mtpserve" / sub
        assert link.is_symlink() and link.resolve() == (ROOT / sub).resolve(), sub
    import mtpserve

    assert mtpserve.MTPServeClient.__module__ == "mtpserve.cluster.service.client"


def test_service_imports_load_no_other_top_level_module() -> None:
    """Importing the CLI, the server and the Ray actors loads project code only under `mtpserve`."""
    code = (
        "import sys, mtpserve.cluster.cli.mtpserve, mtpserve.cluster.service.server, "
        "mtpserve.cluster.distributed.actors, mtpserve.cluster.cli.cmd_serve; "
        "import mtpserve.cluster.engine.scheduler as s; "
        "print(s.__file__); print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert res.returncode == 0, res.stderr
    path, tops = res.stdout.splitlines()[-2:]
    assert Path(path).resolve() == (ROOT / "cluster" / "engine" / "scheduler.py").resolve()
    loaded = set(tops.split())
    assert "mtpserve" in loaded
    assert not loaded & {"cluster", "workers", "speculative", "modeling", "deploy"}, loaded
