"""Soaks of `serve` through the openai client: 64 concurrent workers send greedy streams, close streams mid-way, and
mix in bad requests and oversized prompts; through Ray a target rank is killed midway (Ray restarts it). Every
request ends with a terminal status, no KV block is held at the end, the front end's memory stays flat, and every
greedy stream that finished equals the same request alone."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import ServeProcess, wait_for, write_tiny_model
from tests.helpers.soak import SoakReport, references, rss_mb, soak

pytestmark = pytest.mark.slow
SECONDS = 40.0
WARM_UP_S = 5.0
MAX_RSS_GROWTH_MB = 50.0
ENGINE = {"model": {"device": "cpu", "dtype": "float32"}, "scheduler": {"max_num_requests": 32, "num_kv_blocks": 1200}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, draft head) of a tiny model with SmolLM2's tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def model_and_length(base_url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    model: Any = client.models.list().data[0]
    return model.id, int(model.max_model_len)


def run_soak(base_url: str, front_end_pid: int, midway: Any = None) -> tuple[SoakReport, float]:
    """(the soak's report, the front end's memory growth over it in MB, after a warm-up)."""
    model, max_len = model_and_length(base_url)
    asyncio.run(soak(base_url, model, WARM_UP_S, max_len, seed=1))
    before = rss_mb(front_end_pid)
    series: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(2.0):
            series.append(round(rss_mb(front_end_pid) - before, 1))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rep = asyncio.run(soak(base_url, model, SECONDS, max_len, seed=2, midway=midway))
    done.set()
    print(f"front-end RSS growth every 2 s: {series}")
    return rep, rss_mb(front_end_pid) - before


def check(rep: SoakReport, growth_mb: float, address: str, base_url: str) -> None:
    print(f"ends {dict(rep.ends)}, refusals {dict(rep.refusals)}, front-end growth {growth_mb:.1f} MB")
    assert not rep.cuts, rep.cuts[:5]
    assert rep.ends["finished"] >= 100 and rep.ends["closed by client"] >= 10, rep.ends
    assert rep.ends["refused"] >= 10, rep.ends  # the bad requests and the oversized prompts
    with MTPServeClient(address, timeout=30) as c:
        wait_for(lambda: c.stats()["kv_blocks_used"] == 0 and c.stats()["requests_running"] == 0, 30)
    model, _ = model_and_length(base_url)
    alone = references(base_url, model, sorted(rep.completed))
    differ = [key for key, runs in rep.completed.items() if any(r != alone[key] for r in runs)]
    assert not differ, f"greedy streams that differ from the same request alone: {differ}"
    assert growth_mb < MAX_RSS_GROWTH_MB, f"the front end grew {growth_mb:.0f} MB"


def test_soak_in_process(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(ENGINE))
    model, head = tiny
    args = ["--config", str(tmp_path / "serve.yaml"), "--model", str(model), "--draft", str(head), "--http-port", "0"]
    with ServeProcess(args) as srv:
        assert srv.proc is not None
        rep, growth = run_soak(f"{srv.http_url}/v1", srv.proc.pid)
        check(rep, growth, srv.address, f"{srv.http_url}/v1")
        assert rep.refusals and all(r.startswith("400") for r in rep.refusals), rep.refusals


def test_soak_through_ray_with_a_target_rank_killed(ray_local: Any, tiny: tuple[Path, Path]) -> None:
    from mtpserve.cluster.distributed.scheduler_actor import start_scheduler_actor, stop_scheduler_actor

    model, head = tiny
    cfg = MTPServeConfig.from_dict(
        ENGINE,
        {
            "model.path": str(model),
            "speculative.draft": str(head),
            "parallel.distributed": True,
            "parallel.draft_placement": "colocated",
            "server.port": 0,
            "server.http_port": 0,
            "server.metrics_port": 0,
            "server.frontends": 1,
        },
    )
    actor, address, _, http_address = start_scheduler_actor(cfg)
    killed: list[int] = []

    def kill_rank() -> None:
        pid = ray_local.get(actor.worker_pids.remote())[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    try:
        base_url = f"http://{http_address}/v1"
        _, front_end = ray_local.get(actor.pids.remote())
        rep, growth = run_soak(base_url, front_end, midway=kill_rank)
        assert killed, "the target rank was not killed"
        with MTPServeClient(address, timeout=30) as c:
            deadline = time.monotonic() + 60
            while c.health() != "SERVING":
                assert time.monotonic() < deadline, "the killed rank was not restored"
                time.sleep(1.0)
        assert ray_local.get(actor.worker_pids.remote())[0] != killed[0], "Ray restarted the rank"
        assert rep.ends["error event"] + rep.refusals.total() > 0
        check(rep, growth, address, base_url)
    finally:
        stop_scheduler_actor(actor)
