"""The Ray job entry point warns when `ray job stop` would kill the server before its drain ends."""

from __future__ import annotations

import json

import pytest

from mtpserve.cluster.cli.job import STOP_WAIT_VAR, stop_wait_warning
from mtpserve.workers.config import MTPServeConfig


def test_a_stop_wait_shorter_than_the_drain_is_named_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MTPServeConfig.from_dict({"server": {"drain_timeout_s": 30}})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv(STOP_WAIT_VAR, raising=False)
    assert stop_wait_warning(cfg) is None  # not a Ray job
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    warning = stop_wait_warning(cfg)
    assert warning is not None and "3 s after its SIGTERM" in warning and "30 s drain" in warning
    env = json.loads(warning.split("--runtime-env-json ")[1].strip("'"))
    monkeypatch.setenv(STOP_WAIT_VAR, env["env_vars"][STOP_WAIT_VAR])
    assert stop_wait_warning(cfg) is None  # the suggested setting silences it
    monkeypatch.setenv(STOP_WAIT_VAR, "20")
    assert "20 s after" in (stop_wait_warning(cfg) or "")
    cfg.server.drain_timeout_s = 2
    assert stop_wait_warning(cfg) is None  # a short drain fits
