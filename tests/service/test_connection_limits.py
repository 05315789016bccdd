"""Connections that send nothing, or too little, are closed: an idle HTTP or gRPC connection after
server.idle_timeout_s, one with half its headers too, and a body not all sent within server.body_timeout_s gets
408; at server.max_connections a new HTTP connection closes the oldest idle one, so 20,000 idle connections leave
health, HTTP and gRPC answering; accept errors are logged once per interval. A well-behaved client is served
throughout."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.admission import AcceptErrorLog, connection_cap
from mtpserve.cluster.service.server import MTPServer
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import ROOT, ServeProcess, child_env, wait_for, write_dummy_model, write_tiny_model

TIMEOUT_S = 0.5
CAP = 8


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
                "max_connections": CAP,
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


def test_idle_connections_make_room_for_a_client(server: MTPServer) -> None:
    assert server.http_port is not None and server._http is not None and server._http.cap is not None
    cap = server._http.cap
    before = cap.evicted
    idle = [socket.create_connection(("127.0.0.1", server.http_port), timeout=5) for _ in range(6 * CAP)]
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0, timeout=30
        )
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt=[7, 8], max_tokens=2).usage.completion_tokens == 2
        assert cap.open <= CAP
        assert cap.evicted - before >= 5 * CAP  # the oldest idle ones made room, the client's request was served
        closed = 0
        for s in idle[: 4 * CAP]:
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == 4 * CAP
    finally:
        for s in idle:
            s.close()


def test_connection_cap_follows_the_file_limit() -> None:
    assert connection_cap(None, 1024) == 384  # half of what a reserve of 256 leaves, per port
    assert connection_cap(None, 100) == 16
    assert connection_cap(50, 1_000_000) == 50


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        handler = AcceptErrorLog(interval=0.2)
        loop.set_exception_handler(handler)
        err = OSError(24, "Too many open files")
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": err})
            assert len(caplog.records) == 1
            time.sleep(0.25)
            loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": err})
            assert len(caplog.records) == 2
            assert "and 999 more" in caplog.records[1].getMessage()
            loop.call_exception_handler({"message": "Task exception was never retrieved"})
            loop.call_exception_handler({"message": "Task exception was never retrieved"})
            assert len(caplog.records) == 4  # other errors are never held back
    finally:
        loop.close()


HOLD_IDLE = """
import socket, sys
opened, failed = [], 0
for _ in range(int(sys.argv[2])):
    try:
        opened.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10))
    except OSError:
        failed += 1
print(len(opened), failed, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_twenty_thousand_idle_connections_leave_the_server_answering(tmp_path: Path) -> None:
    model, head = write_tiny_model(tmp_path)
    args = ["--model", str(model), "--draft", str(head), "--device", "cpu", "--dtype", "float32", "--http-port", "0"]
    with ServeProcess(args, open_files=1024) as srv:  # 384 connections a port; each idle one holds a file
        holders = [
            subprocess.Popen(
                [sys.executable, "-c", HOLD_IDLE, str(srv.http_port), "10000"],
                cwd=ROOT,
                env=child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            counts = []
            for h in holders:
                assert h.stdout is not None
                counts.append([int(x) for x in h.stdout.readline().split()])
            assert sum(c[0] for c in counts) >= 19_000, counts  # opened while the server kept closing old ones
            with urllib.request.urlopen(f"{srv.http_url}/health", timeout=10) as r:
                assert r.status == 200
            client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
            model_id = client.models.list().data[0].id
            done = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=4, temperature=0)
            assert done.usage.completion_tokens == 4
            with grpc.insecure_channel(srv.address) as ch:
                check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)
                )
                outs = list(pb_grpc.InferenceStub(ch).Generate(req, timeout=60))
                assert sum(len(o.token_ids) for o in outs) == 4
        finally:
            for h in holders:
                h.kill()
                h.wait()
        assert srv.log.count("out of system resource") <= 3, srv.log[-3000:]


def test_old_grpc_connections_are_asked_to_reconnect_without_cutting_calls(tmp_path: Path) -> None:
    """server.max_connection_age_s: a connection that old gets GOAWAY (the channel goes IDLE and reconnects for
    the next call), while a stream already running on it finishes."""
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(write_dummy_model(tmp_path)), "load_format": "dummy", "device": "cpu"},
            "speculative": {"draft": "random", "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 64, "max_num_requests": 4},
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "max_connection_age_s": 1.0},
        }
    )
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=False)
    srv.start()
    try:
        states: list[str] = []
        with grpc.insecure_channel(srv.address) as channel:
            channel.subscribe(lambda s: states.append(s.name), try_to_connect=True)
            stub = pb_grpc.InferenceStub(channel)
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[3, 4, 5]), sampling=pb.SamplingParams(max_tokens=450, ignore_eos=True)
            )
            t0 = time.monotonic()
            assert sum(len(m.token_ids) for m in stub.Generate(req, timeout=60)) == 450
            took = time.monotonic() - t0
            wait_for(lambda: states.count("READY") >= 1 and states[-1] == "IDLE", 5.0)
            short = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4]), sampling=pb.SamplingParams(max_tokens=2))
            assert sum(len(m.token_ids) for m in stub.Generate(short, timeout=60)) == 2
            assert states.count("READY") == 2, states  # a new connection
        assert took > 1.0, f"the stream took {took:.2f} s, less than the connection's age limit"
    finally:
        srv.stop()
