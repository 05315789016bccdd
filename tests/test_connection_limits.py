"""Connections that send nothing, or too little, are closed: an idle HTTP or gRPC connection after
server.idle_timeout_s, one with half its headers too, and a body not all sent within server.body_timeout_s gets
408; a well-behaved client is served throughout."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import openai
import pytest

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig

from helpers_service import write_dummy_model

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MTPServer]:
    model = write_dummy_model(tmp_path_factory.mktemp("dummy"))
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "load_format": "dummy", "device": "cpu"},
            "speculative": {"draft": "random", "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 64, "max_num_requests": 4},
            "server": {
                "host": "127.0.0.1",
                "port": 0,
                "http_port": 0,
                "metrics_port": 0,
                "idle_timeout_s": TIMEOUT_S,
                "body_timeout_s": TIMEOUT_S,
            },
        }
    )
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=False)
    srv.start()
    yield srv
    srv.stop()


def closed_within(port: int, send: bytes, seconds: float) -> tuple[bool, bytes]:
    """Connect, send `send`, then read until the server closes; (closed in time, what it sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as s:
        if send:
            s.sendall(send)
        got = b""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return False, got
            except ConnectionResetError:
                return True, got
            if not chunk:
                return True, got
            got += chunk
        return False, got


def test_idle_and_slow_connections_are_closed(server: MTPServer) -> None:
    assert server.http_port is not None
    http, grpc_port = server.http_port, server.port
    assert closed_within(http, b"", 5.0)[0]  # opened, sent nothing
    assert closed_within(http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 5.0)[0]  # half its headers
    assert closed_within(grpc_port, b"", 5.0)[0]  # no HTTP/2 preface: the handshake times out
    slow_body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow_body += b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
    _, reply = closed_within(http, slow_body, 5.0)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"server.body_timeout_s" in reply
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt=[3, 4, 5], max_tokens=3).usage.completion_tokens == 3
