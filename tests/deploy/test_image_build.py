"""The container image, built here and run: deploy/docker/build-local.sh builds the image the KubeRay manifests
name (buildah on a Debian stand-in for the Ray base, no daemon, no registry), and the image answers gRPC.

Needs root, buildah and mmdebstrap (`.ci/run` installs both from Debian's packages). Everything the test
builds lives in a buildah storage folder of its own, removed at the end; only the Debian root file system
stays cached (under ~/.cache/mtpserve/image, named after the inputs that made it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.deploy import consistency, render
from tests.helpers.service import SERVING_LINE, child_env, free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(
    os.environ.get("MTPSERVE_IMAGE_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtpserve" / "image"
)
IMAGE = consistency.IMAGE
PROMPT = "Explain speculative decoding in two sentences."
MAX_TOKENS = 32


def _missing() -> str | None:
    for tool in ("buildah", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y buildah mmdebstrap; .ci/run does)"
    if os.geteuid() != 0:
        return "buildah --isolation chroot and mmdebstrap need root"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
]


def buildah_cmd(storage: Path) -> list[str]:
    """buildah on a storage folder of its own (vfs: no overlay mounts needed)."""
    return ["buildah", "--storage-driver", "vfs", "--root", str(storage), "--runroot", f"{storage}.run"]


@dataclass
class Built:
    """The built image in a private buildah storage, and one working container made from it."""

    storage: Path
    build_seconds: float
    build_log: str
    container: str = ""

    def buildah(self, *args: str, timeout: float = 600) -> str:
        """Run buildah on this storage; returns stdout, fails the test with its output on error."""
        cmd = [*buildah_cmd(self.storage), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def run_args(self, *args: str, env: dict[str, str] | None = None) -> list[str]:
        """`buildah run` arguments for a command in the working container (the image's user, env and folder)."""
        flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
        return ["run", "--isolation", "chroot", *flags, self.container, "--", *args]

    def run(self, *args: str, timeout: float = 300) -> str:
        """Run a command in the working container; returns its stdout."""
        return self.buildah(*self.run_args(*args), timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    storage = tmp_path_factory.mktemp("buildah") / "storage"
    env = {**os.environ, "BUILDAH_ROOT": str(storage), "MTPSERVE_IMAGE": IMAGE, "PYTHON": sys.executable}
    env["MTPSERVE_IMAGE_CACHE"] = str(CACHE)
    t0 = time.monotonic()
    script = ROOT / "deploy" / "docker" / "build-local.sh"
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=1500, check=False)
    image = Built(storage, time.monotonic() - t0, done.stdout)
    try:
        assert done.returncode == 0, f"build-local.sh failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
        image.container = image.buildah("from", "--pull-never", IMAGE).strip()
        yield image
    finally:
        for args in (["rm", "--all"], ["rmi", "--all", "--force"]):
            subprocess.run([*buildah_cmd(storage), *args], capture_output=True, timeout=600, check=False)
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(f"{storage}.run", ignore_errors=True)


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """Print a figure into the test run's output, past pytest's capture."""
    with capsys.disabled():
        print(f"\n[image] {line}")


def test_the_built_image_agrees_with_the_manifests(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    info = json.loads(built.buildah("inspect", "--type", "image", IMAGE))
    config = info["OCIv1"]["config"]
    assert consistency.built_image_errors(config, render.render(ROOT / "deploy" / "k8s" / "base")) == []
    assert config["Labels"]["org.opencontainers.image.version"] == IMAGE.rsplit(":", 1)[1]
    tarballs = list(CACHE.glob("debian-*/rootfs.tar"))
    assert tarballs and all(t.is_file() for t in tarballs), tarballs  # the cache a later build reuses
    size = next(i["size"] for i in json.loads(built.buildah("images", "--json")) if IMAGE in (i.get("names") or []))
    base = "cached" if "cached root file system" in built.build_log else "made by mmdebstrap"
    report(capsys, f"built {IMAGE} in {built.build_seconds:.0f} s (Debian root file system {base}); size {size}")


def test_the_image_runs_as_uid_1000_with_the_model_baked_in(built: Built) -> None:
    assert built.run("id", "-u").strip() == "1000"
    assert "serve" in built.run("mtpserve", "--help")
    # the application the RayService manifest names imports (its Ray Serve dependencies are installed)
    app = built.run("python", "-c", "from mtpserve.cluster.cli.serve_app import app; print(app.__name__)")
    assert app.strip().splitlines()[-1] == "app"
    probe = (
        "import glob, json, os\n"
        "before = sorted(glob.glob(os.environ['MTPSERVE_CACHE'] + '/*/.complete'))\n"
        "from mtpserve.modeling.loader import resolve_model\n"
        "path = str(resolve_model(None).directory)\n"
        "owners = {os.stat(os.path.join(path, f)).st_uid for f in os.listdir(path)}\n"
        "print(json.dumps({'before': before, 'path': path, 'owners': sorted(owners)}))\n"
    )
    found = json.loads(built.run("python", "-c", probe).strip().splitlines()[-1])
    # The converted model was already there, at the name the loader looks up, owned by the pods' user.
    assert found["path"] + "/.complete" in found["before"], found
    assert found["owners"] == [1000], found


def test_the_image_serves_the_same_greedy_tokens_as_a_local_engine(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    port, metrics_port = free_port(), free_port()
    serve = ["mtpserve", "serve", "--port", str(port), "--metrics-port", str(metrics_port)]
    cmd = [*buildah_cmd(built.storage), *built.run_args(*serve, env={"OMP_NUM_THREADS": "1"})]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if SERVING_LINE.search(line):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "mtpserve serve did not start:\n" + "".join(lines)
        start_seconds = time.monotonic() - t0
        assert "converting" not in "".join(lines), "the baked model was converted again at start"
        with MTPServeClient(f"127.0.0.1:{port}", timeout=120) as client:
            client.wait_ready(30)
            assert client.health() == "SERVING"
            t1 = time.monotonic()
            served = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            generate_seconds = time.monotonic() - t1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    local = subprocess.run(
        [sys.executable, "-m", "mtpserve", "generate", "--local", "--json", "--prompt", PROMPT,
         "--max-tokens", str(MAX_TOKENS), "--temperature", "0"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr[-4000:]
    expected = json.loads(local.stdout)
    assert len(served["token_ids"]) == MAX_TOKENS, served  # the prompt runs to the limit: 32 tokens to compare
    assert served["token_ids"] == expected["token_ids"], (served, expected)
    report(
        capsys,
        f"serve started in {start_seconds:.1f} s; {len(served['token_ids'])} greedy tokens over gRPC in "
        f"{generate_seconds:.2f} s, same as generate --local; acceptance length {served['stats']['acceptance_length']}",
    )
