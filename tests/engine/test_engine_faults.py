"""An engine in this process behind gRPC and HTTP, with faults injected: an engine error fails the requests in
flight and the loop serves on; workers down give UNAVAILABLE / 503 and NOT_SERVING until a step succeeds; the
distributed engine's health hook drives health and admission; an error mid-stream reaches the HTTP client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import openai
import pytest

from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.server import MTPServer
from tests.helpers.service import dummy_server_config, rpc_error, wait_for, write_dummy_model
from tests.service.test_grpc_service import long_request, wait_idle
from tests.service.test_http_api import TEXT, http


@pytest.fixture(scope="module")
def inproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MTPServer]:
    """An MTPServer in this process on a dummy-weight model (no tokenizer), gRPC and HTTP on port 0, metrics off."""
    cfg = dummy_server_config(write_dummy_model(tmp_path_factory.mktemp("dummy")))
    cfg.server.http_port = 0
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=False)
    srv.start()
    yield srv
    srv.stop()


def _fail_next_step(srv: MTPServer, exc: Exception) -> None:
    """Fault injection: the real engine's next target step raises `exc`, later steps run normally."""
    target = srv.engine.target
    real: Callable[..., Any] = target.execute

    def execute(plan: Any) -> Any:
        target.execute = real  # type: ignore[method-assign]
        raise exc

    target.execute = execute  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("exc", "detail", "health"),
    [
        (RuntimeError("boom"), "boom", "SERVING"),  # an engine error: the loop serves on
        (WorkerUnavailableError("target rank 1 died"), "workers are down", "NOT_SERVING"),  # until a step succeeds
    ],
)
def test_a_failed_step_ends_the_streams_in_flight_and_the_loop_serves_on(
    inproc: MTPServer, exc: Exception, detail: str, health: str
) -> None:
    with MTPServeClient(f"127.0.0.1:{inproc.port}", timeout=30) as c:
        call = c.stub.Generate(long_request(max_tokens=200, prompt=[3, 4, 5, 6]), timeout=30)
        next(call)
        _fail_next_step(inproc, exc)
        err = rpc_error(lambda: list(call))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and detail in err.details()
        assert c.health() == health
        assert c.generate(token_ids=[3, 4, 5], max_tokens=5, ignore_eos=True)["finish_reason"] == "length"
        assert c.health() == "SERVING"
        assert wait_idle(c)["kv_blocks_used"] == 0


def test_set_serving_hook_drives_health_and_admission(inproc: MTPServer) -> None:
    with MTPServeClient(f"127.0.0.1:{inproc.port}", timeout=30) as c:
        inproc.set_serving(False)
        try:
            assert c.health() == "NOT_SERVING"
            err = rpc_error(lambda: c.generate(token_ids=[3, 4], max_tokens=2))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            inproc.set_serving(True)
        assert c.health() == "SERVING"
        assert c.generate(token_ids=[3, 4], max_tokens=2, ignore_eos=True)["finish_reason"] == "length"


def test_health_and_admission_follow_the_workers(inproc: MTPServer) -> None:
    """/health turns 503 while the workers are down, and completions get 503 with an error body."""
    url = f"http://{inproc.http_address}"
    body = {"prompt": [3, 4, 5], "max_tokens": 2}
    inproc.set_serving(False)
    try:
        assert http("GET", f"{url}/health") == (503, {"status": "not_serving"})
        status, obj = http("POST", f"{url}{TEXT}", body)
        assert status == 503 and obj["error"]["type"] == "server_error"
    finally:
        inproc.set_serving(True)
    assert http("GET", f"{url}/health")[0] == 200
    status, obj = http("POST", f"{url}{TEXT}", body)
    assert status == 200 and obj["choices"][0]["finish_reason"] in ("length", "stop")


def test_engine_failure_mid_stream_reaches_the_client(inproc: MTPServer) -> None:
    """An engine error after the stream began arrives as an error event (the openai client raises); the
    server then serves the next request and holds no KV block."""
    c = openai.OpenAI(base_url=f"http://{inproc.http_address}/v1", api_key="unused", max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    stream = c.completions.create(
        model=model, prompt=[3, 4, 5, 6], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    _fail_next_step(inproc, RuntimeError("boom"))
    with pytest.raises(openai.APIError, match="boom"):
        list(it)
    out = c.completions.create(model=model, prompt=[3, 4], max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    blocks = inproc.engine.scheduler.blocks
    wait_for(lambda: blocks.num_free == blocks.num_blocks)
