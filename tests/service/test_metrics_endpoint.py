"""The /metrics endpoint: on loopback unless server.metrics_host says otherwise, and behind a bearer token with
server.metrics_auth_token_file."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.service import write_dummy_model
from tests.service.test_security import TOKEN, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    token = tmp_path_factory.mktemp("secrets") / "token"
    token.write_text(TOKEN + "\n")
    return {"token": token}


def test_metrics_stay_on_loopback_when_serving_everywhere(model_dir: Path) -> None:
    """--host 0.0.0.0 puts gRPC on every address, but /metrics (no token, no TLS) stays on 127.0.0.1 unless
    server.metrics_host says otherwise."""
    srv = start_server(model_dir, {"host": "0.0.0.0", "allow_insecure": True}, metrics=True)
    try:
        assert srv.metrics._http.host == "127.0.0.1"
        assert srv.address.startswith("0.0.0.0:")
    finally:
        srv.stop()
    srv = start_server(model_dir, {"metrics_host": "0.0.0.0"}, metrics=True)
    try:
        assert srv.metrics._http.host == "0.0.0.0"
    finally:
        srv.stop()


def test_metrics_can_require_a_token(model_dir: Path, pki: dict[str, Path]) -> None:
    """With server.metrics_auth_token_file, /metrics answers 401 without the token or with another one."""
    srv = start_server(model_dir, {"metrics_auth_token_file": str(pki["token"])}, metrics=True)
    try:
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        for token in (None, "wrong", TOKEN + "x"):
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=10)
            assert refused.value.code == 401
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200 and b"mtpserve_requests_running" in resp.read()
    finally:
        srv.stop()
