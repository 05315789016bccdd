"""The Ray job route: a local Ray head with token auth, `ray job submit`, the client, `ray job stop`, head stop.

Auth: Ray 2.60 clusters keep token authentication on. The head, the CLI clients and (through the raylet's
environment) the job itself all get RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at a token
file in a temp dir, so the test never touches ~/.ray. Without RAY_AUTH_MODE=token the CLI does not
send the token and the dashboard answers "Missing authentication token".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from mtpserve.cluster.client import MTPServeClient
from tests.helpers.service import ROOT, child_env, free_port, rpc_error, wait_for, write_dummy_model

pytestmark = pytest.mark.slow
VENV_BIN = str(Path(sys.executable).parent)


@dataclass
class RayHead:
    """A `ray start --head --block` process of our own, with its ports and environment."""

    proc: subprocess.Popen[str]
    temp_dir: Path
    dashboard: str
    env: dict[str, str]

    def ray(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the `ray` CLI of this venv against this head."""
        cmd = [os.path.join(VENV_BIN, "ray"), *args]
        out = subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"ray {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out


def _our_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions `marker` (our head's temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(entry.name))
    return pids


def _stop_head(head: RayHead) -> None:
    """SIGTERM our blocking `ray start` (it tears down its processes), then kill stragglers by PID."""
    if head.proc.poll() is None:
        head.proc.send_signal(signal.SIGTERM)
        try:
            head.proc.wait(60)
        except subprocess.TimeoutExpired:
            head.proc.kill()
    marker = str(head.temp_dir)
    try:
        wait_for(lambda: not _our_processes(marker), timeout=20, interval=0.5)
    except TimeoutError:
        for pid in _our_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A local Ray head (2 CPUs, dashboard for job submission, token auth) on free ports."""
    temp_dir = Path(tempfile.mkdtemp(prefix="mtpray", dir="/tmp"))  # short: Ray's socket paths have a limit
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = child_env(
        PATH=os.pathsep.join([VENV_BIN, os.environ.get("PATH", "")]),  # the job's `python` is this venv's
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
    )
    dash_port = free_port()
    cmd = [
        os.path.join(VENV_BIN, "ray"), "start", "--head", "--block",
        f"--port={free_port()}", "--num-cpus=2", "--num-gpus=0",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir / 'ray'}", "--disable-usage-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    head = RayHead(proc, temp_dir, f"http://127.0.0.1:{dash_port}", env)
    try:
        wait_for(lambda: head.ray("job", "list", "--address", head.dashboard, check=False).returncode == 0, 120, 2)
        yield head
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_serves_grpc_and_stops_cleanly(ray_head: RayHead, tmp_path: Path) -> None:
    model = write_dummy_model(tmp_path / "dummy")
    port = free_port()
    job_id = f"mtpserve-test-{secrets.token_hex(4)}"
    address = ["--address", ray_head.dashboard]

    no_auth_env = {k: v for k, v in ray_head.env.items() if k != "RAY_AUTH_MODE"}
    denied = subprocess.run(
        [os.path.join(VENV_BIN, "ray"), "job", "list", *address], env=no_auth_env, capture_output=True, text=True
    )
    assert denied.returncode != 0 and "authentication token" in (denied.stdout + denied.stderr).lower()

    ray_head.ray(
        "job", "submit", *address, "--working-dir", ".", "--submission-id", job_id, "--no-wait",
        "--runtime-env-json", json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "45"}}), "--",
        "python", "-m", "mtpserve.cluster.job", "--model", str(model), "--load-format", "dummy", "--device", "cpu",
        "--draft", "random", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
    )  # fmt: skip
    try:
        with MTPServeClient(f"127.0.0.1:{port}", timeout=30) as client:
            try:
                client.wait_ready(timeout=120)
            except grpc.FutureTimeoutError:
                failed = ray_head.ray("job", "logs", *address, job_id, check=False)
                pytest.fail(f"the job never served gRPC:\n{failed.stdout}\n{failed.stderr}")
            assert client.health() == "SERVING"
            assert client.model_info()["vocab_size"] == 256
            out = client.generate(token_ids=[5, 6, 7, 8], max_tokens=6, ignore_eos=True)
            assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
            assert out["stats"]["verify_steps"] > 0
            logs = ray_head.ray("job", "logs", *address, job_id).stdout
            assert "connected to Ray" in logs and f"(python {VENV_BIN}" in logs, logs
            assert "kills this job" not in logs, "the stop wait covers the drain: no warning"

            t0 = time.monotonic()
            ray_head.ray("job", "stop", *address, job_id)
            stop_s = time.monotonic() - t0
            status = ray_head.ray("job", "status", *address, job_id).stdout
            assert f"Job '{job_id}' was stopped" in status, status
            logs = ray_head.ray("job", "logs", *address, job_id).stdout
            assert "received SIGTERM" in logs and "mtpserve: stopped" in logs, logs
            assert stop_s < 10, f"ray job stop took {stop_s:.1f}s (a SIGKILL fallback?)"
            err = rpc_error(lambda: client.health())
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ray_head.ray("job", "stop", *address, job_id, check=False)
