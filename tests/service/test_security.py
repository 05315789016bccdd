"""TLS, mutual TLS and the bearer-token check on the public gRPC and HTTP APIs, on loopback with real
certificates."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from mtpserve.cluster.engine.errors import ConfigError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.server import MTPServer
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import ROOT, ServeProcess, child_env, rpc_error, write_dummy_model

TOKEN = "s3cret-token-for-tests"
PROMPT = [3, 4, 5, 6]


# ---- certificates --------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def make_ca(directory: Path, cn: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA: (its PEM path, key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{cn}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def issue(
    directory: Path, name: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, server: bool
) -> tuple[Path, Path]:
    """A certificate signed by the CA (for 127.0.0.1 and localhost when `server`): (cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path = directory / f"{name}.crt"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write_key(key, directory / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A server CA with a server certificate, a client CA with a client certificate, and an unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    server_ca, sk, sc = make_ca(d, "server-ca")
    client_ca, ck, cc = make_ca(d, "client-ca")
    other_ca, ok, oc = make_ca(d, "other-ca")
    server_cert, server_key = issue(d, "server", sk, sc, server=True)
    client_cert, client_key = issue(d, "client", ck, cc, server=False)
    rogue_cert, rogue_key = issue(d, "rogue", ok, oc, server=False)
    token = d / "token"
    token.write_text(TOKEN + "\n")
    return {
        "server_ca": server_ca,
        "client_ca": client_ca,
        "other_ca": other_ca,
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
        "rogue_cert": rogue_cert,
        "rogue_key": rogue_key,
        "token": token,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dummy-weight model directory (token ids only)."""
    return write_dummy_model(tmp_path_factory.mktemp("dummy"))


def start_server(
    model: Path, server: dict[str, Any], metrics: bool = False, scheduler: dict[str, Any] | None = None
) -> MTPServer:
    """An MTPServer in this process on loopback, port 0, with the given server (and scheduler) settings."""
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "load_format": "dummy", "device": "cpu"},
            "speculative": {"draft": "random", "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 64, "max_num_requests": 4, **(scheduler or {})},
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, **server},
        }
    )
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=metrics)
    srv.start()
    return srv


def free_blocks(srv: MTPServer) -> int:
    """Free KV blocks of the server's engine."""
    return srv.engine.scheduler.blocks.num_free


# ---- bearer token --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_server(model_dir: Path, pki: dict[str, Path]) -> Iterator[MTPServer]:
    """A plaintext server that requires the bearer token, with metrics and the HTTP API on."""
    srv = start_server(model_dir, {"auth_token_file": str(pki["token"]), "http_port": 0}, metrics=True)
    yield srv
    srv.stop()


def test_missing_or_wrong_token_is_unauthenticated_and_counted(token_server: MTPServer) -> None:
    """No token and a wrong token both end with UNAUTHENTICATED; each refusal is counted by reason; health
    stays open for probes; the right token generates; no KV block is held afterwards."""
    addr = f"127.0.0.1:{token_server.port}"
    total = token_server.engine.scheduler.blocks.num_blocks
    with MTPServeClient(addr, timeout=30) as anonymous:
        assert anonymous.health() == "SERVING"
        err = rpc_error(lambda: anonymous.generate(token_ids=PROMPT, max_tokens=4))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "missing bearer token" in err.details()
        assert rpc_error(anonymous.stats).code() == grpc.StatusCode.UNAUTHENTICATED
    with MTPServeClient(addr, timeout=30, auth_token="not-" + TOKEN) as wrong:
        err = rpc_error(lambda: wrong.generate(token_ids=PROMPT, max_tokens=4))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid bearer token" in err.details()
    with MTPServeClient(addr, timeout=30, auth_token=TOKEN) as good:
        out = good.generate(token_ids=PROMPT, max_tokens=6)
        assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
        assert good.stats()["requests_finished"] >= 1
    assert free_blocks(token_server) == total
    page = urllib.request.urlopen(f"http://127.0.0.1:{token_server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'mtpserve_auth_failures_total{frontend="grpc",reason="missing"} 2.0' in page
    assert 'mtpserve_auth_failures_total{frontend="grpc",reason="invalid"} 1.0' in page


def _http_status(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        return exc.code


def test_http_api_takes_the_same_token(token_server: MTPServer) -> None:
    """Over HTTP the same token is needed: none or a wrong one gets 401 (counted under frontend="http"),
    /health stays open, the right token completes; no KV block is held afterwards."""
    base = f"http://{token_server.http_address}"
    assert _http_status(f"{base}/health") == 200
    assert _http_status(f"{base}/v1/models") == 401
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="not-" + TOKEN, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert denied.value.status_code == 401 and "invalid bearer token" in denied.value.message
    good = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    model = good.models.list().data[0].id
    out = good.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    assert free_blocks(token_server) == token_server.engine.scheduler.blocks.num_blocks
    conn = http.client.HTTPConnection(token_server.http_address, timeout=30)  # a byte that is not UTF-8: refused too
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", b"Bearer \xff" + TOKEN.encode())
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and b"invalid bearer token" in resp.read()
    conn.close()
    page = urllib.request.urlopen(f"http://127.0.0.1:{token_server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'mtpserve_auth_failures_total{frontend="http",reason="missing"} 1.0' in page
    assert 'mtpserve_auth_failures_total{frontend="http",reason="invalid"} 2.0' in page


def test_generate_cli_sends_the_token(token_server: MTPServer, pki: dict[str, Path]) -> None:
    """`mtpserve generate --server` without a token exits 1 naming UNAUTHENTICATED; with --auth-token-file or
    $MTPSERVE_AUTH_TOKEN the call reaches the engine; a missing token file exits 2."""
    addr = f"127.0.0.1:{token_server.port}"
    base = [sys.executable, "-m", "mtpserve", "generate", "--server", addr, "--prompt", "hi", "--raw"]
    env = child_env()
    env.pop("MTPSERVE_AUTH_TOKEN", None)

    def cli(*extra: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *extra], cwd=ROOT, env={**env, **env_extra}, capture_output=True, text=True, timeout=120
        )

    denied = cli("--max-tokens", "2")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    ok = cli("--max-tokens", "2", "--auth-token-file", str(pki["token"]))
    # past the token check: the engine itself refuses text for a model without a tokenizer
    assert ok.returncode == 1 and "INVALID_ARGUMENT" in ok.stderr and "UNAUTHENTICATED" not in ok.stderr
    ok_env = cli("--max-tokens", "2", MTPSERVE_AUTH_TOKEN=TOKEN)
    assert ok_env.returncode == ok.returncode and ok_env.stderr == ok.stderr
    missing = cli("--auth-token-file", str(pki["token"]) + ".nope")
    assert missing.returncode == 2 and "No such file" in missing.stderr


# ---- TLS -----------------------------------------------------------------------------------------
def test_tls_server_accepts_trusting_clients_only(model_dir: Path, pki: dict[str, Path]) -> None:
    """A TLS server serves clients that trust its CA; a plaintext client and a client trusting another CA
    cannot call it."""
    srv = start_server(model_dir, {"tls": {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"])}})
    addr = f"127.0.0.1:{srv.port}"
    try:
        with MTPServeClient(addr, timeout=30, tls_ca_file=str(pki["server_ca"])) as good:
            assert len(good.generate(token_ids=PROMPT, max_tokens=3)["token_ids"]) == 3
        with MTPServeClient(addr, timeout=5) as plain:
            assert rpc_error(lambda: plain.generate(token_ids=PROMPT, max_tokens=3)).code() == (
                grpc.StatusCode.UNAVAILABLE
            )
        with MTPServeClient(addr, timeout=5, tls_ca_file=str(pki["other_ca"])) as untrusting:
            assert rpc_error(lambda: untrusting.generate(token_ids=PROMPT, max_tokens=3)).code() == (
                grpc.StatusCode.UNAVAILABLE
            )
    finally:
        srv.stop()


def test_mutual_tls_and_token_together(model_dir: Path, pki: dict[str, Path]) -> None:
    """With a client CA the server needs a client certificate it signed, and the token on top."""
    srv = start_server(
        model_dir,
        {
            "host": "0.0.0.0",
            "tls": {
                "cert_file": str(pki["server_cert"]),
                "key_file": str(pki["server_key"]),
                "client_ca_file": str(pki["client_ca"]),
            },
            "auth_token_file": str(pki["token"]),
        },
    )
    addr = f"127.0.0.1:{srv.port}"
    ca = str(pki["server_ca"])
    mine = {"tls_cert_file": str(pki["client_cert"]), "tls_key_file": str(pki["client_key"])}
    rogue = {"tls_cert_file": str(pki["rogue_cert"]), "tls_key_file": str(pki["rogue_key"])}
    try:
        with MTPServeClient(addr, timeout=30, tls_ca_file=ca, auth_token=TOKEN, **mine) as good:
            assert len(good.generate(token_ids=PROMPT, max_tokens=3)["token_ids"]) == 3
        with MTPServeClient(addr, timeout=30, tls_ca_file=ca, **mine) as no_token:
            err = rpc_error(lambda: no_token.generate(token_ids=PROMPT, max_tokens=3))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        for who in ({}, rogue):
            with MTPServeClient(addr, timeout=5, tls_ca_file=ca, auth_token=TOKEN, **who) as refused:
                err = rpc_error(lambda c=refused: c.generate(token_ids=PROMPT, max_tokens=3))
                assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def _https_client(base: str, pki: dict[str, Path], ca: str, who: str | None, token: str) -> openai.OpenAI:
    """An openai client over HTTPS trusting `ca`, presenting the client certificate `who` (if any)."""
    ctx = ssl.create_default_context(cafile=str(pki[ca]))
    if who is not None:
        ctx.load_cert_chain(str(pki[f"{who}_cert"]), str(pki[f"{who}_key"]))
    http = httpx2.Client(verify=ctx, timeout=10)
    return openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, http_client=http)


def test_http_api_takes_the_same_mutual_tls(model_dir: Path, pki: dict[str, Path]) -> None:
    """The HTTP port speaks TLS from the same files: a client with a certificate the client CA signed and the
    token completes; without the token it gets 401; plaintext, an untrusting client, no certificate or a
    rogue one cannot connect."""
    tls = {
        "cert_file": str(pki["server_cert"]),
        "key_file": str(pki["server_key"]),
        "client_ca_file": str(pki["client_ca"]),
    }
    srv = start_server(model_dir, {"tls": tls, "auth_token_file": str(pki["token"]), "http_port": 0})
    base = f"https://127.0.0.1:{srv.http_port}"
    try:
        good = _https_client(base, pki, "server_ca", "client", TOKEN)
        model = good.models.list().data[0].id
        assert good.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            _https_client(base, pki, "server_ca", "client", "wrong").models.list()
        refused = [
            openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=TOKEN, max_retries=0, timeout=10),
            _https_client(base, pki, "other_ca", "client", TOKEN),
            _https_client(base, pki, "server_ca", None, TOKEN),
            _https_client(base, pki, "server_ca", "rogue", TOKEN),
        ]
        for client in refused:
            with pytest.raises(openai.APIConnectionError):
                client.models.list()
        assert free_blocks(srv) == srv.engine.scheduler.blocks.num_blocks
    finally:
        srv.stop()


@pytest.mark.slow
def test_every_front_end_process_takes_the_same_mutual_tls_and_token(model_dir: Path, pki: dict[str, Path]) -> None:
    """`serve --frontends 2`: over fresh connections (the kernel spreads them over both processes) a trusted client
    with a certificate and the token completes over HTTPS and gRPC, the wrong token gets 401 / UNAUTHENTICATED, and
    plaintext or no client certificate cannot connect."""
    args = ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu", "--draft", "random"]
    args += ["--frontends", "2", "--http-port", "0", "--auth-token-file", str(pki["token"])]
    args += ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    args += ["--tls-client-ca", str(pki["client_ca"]), "--server.metrics-auth-token-file", str(pki["token"])]
    with ServeProcess(args, startup_timeout=240) as srv:
        metrics = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(metrics, timeout=10)
        req = urllib.request.Request(metrics, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert b"mtpserve_" in resp.read()
        base = f"https://127.0.0.1:{srv.http_port}"
        for _ in range(8):
            good = _https_client(base, pki, "server_ca", "client", TOKEN)
            model = good.models.list().data[0].id
            assert good.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
            good.close()
            with pytest.raises(openai.AuthenticationError):
                _https_client(base, pki, "server_ca", "client", "wrong").models.list()
            for refused in (
                openai.OpenAI(
                    base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=TOKEN, max_retries=0, timeout=10
                ),
                _https_client(base, pki, "server_ca", None, TOKEN),
            ):
                with pytest.raises(openai.APIConnectionError):
                    refused.models.list()
            creds = grpc.ssl_channel_credentials(
                pki["server_ca"].read_bytes(), pki["client_key"].read_bytes(), pki["client_cert"].read_bytes()
            )
            with grpc.secure_channel(srv.address, creds) as channel:
                stub = pb_grpc.InferenceStub(channel)
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=3))
                got = list(stub.Generate(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=60))
                assert sum(len(m.token_ids) for m in got) == 3
                err = rpc_error(lambda: list(stub.Generate(req, metadata=[("authorization", "Bearer no")], timeout=60)))  # noqa: B023
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_open_health_watches_cannot_starve_authenticated_calls(model_dir: Path, pki: dict[str, Path]) -> None:
    """Health is open, so its Watch streams get a budget of their own (an eighth of the server's call limit): 40
    unauthenticated watches of a server that runs 28 calls at once hold 3 slots, the rest get RESOURCE_EXHAUSTED,
    and an authenticated Generate and a Health.Check still answer."""
    srv = start_server(model_dir, {"auth_token_file": str(pki["token"])}, scheduler={"max_queue": 8})
    watchers: list[Any] = []
    try:
        assert srv.health.max_watches == 3
        channel = grpc.insecure_channel(srv.address)
        health = health_pb2_grpc.HealthStub(channel)
        outcomes = []
        for _ in range(40):
            call = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
            watchers.append(call)
            try:
                outcomes.append(next(call).status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError as exc:
                outcomes.append(exc.code())
        assert outcomes.count(True) == 3
        assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 37
        with MTPServeClient(srv.address, timeout=30, auth_token=TOKEN) as client:
            assert len(client.generate(token_ids=PROMPT, max_tokens=3)["token_ids"]) == 3
            assert client.health() == "SERVING"
    finally:
        for call in watchers:
            call.cancel()
        srv.stop()


# ---- configuration -------------------------------------------------------------------------------
def test_exposed_binds_need_credentials_or_an_explicit_opt_out() -> None:
    """A non-loopback host without TLS or a token is refused naming server.host; TLS files come in pairs;
    loopback stays open by default."""
    with pytest.raises(ValidationError, match=re.escape("server.host '0.0.0.0' is reachable")):
        MTPServeConfig.from_dict({"server": {"host": "0.0.0.0"}})
    assert MTPServeConfig.from_dict({"server": {"host": "0.0.0.0", "allow_insecure": True}}).server.allow_insecure
    assert MTPServeConfig.from_dict({"server": {"host": "10.1.2.3", "auth_token_file": "/t"}})
    assert MTPServeConfig().server.host == "127.0.0.1"
    with pytest.raises(ValidationError, match=re.escape("cert_file and server.tls.key_file must be given together")):
        MTPServeConfig.from_dict({"server": {"tls": {"cert_file": "/c"}}})
    with pytest.raises(ValidationError, match="client_ca_file"):
        MTPServeConfig.from_dict({"server": {"tls": {"client_ca_file": "/ca"}}})


def test_unreadable_credentials_fail_before_serving(model_dir: Path, tmp_path: Path) -> None:
    """A missing or empty token file raises ConfigError naming the field; `mtpserve serve` exits 2 with it
    before loading the model."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, why in ((tmp_path / "absent", "cannot read"), (empty, "is empty")):
        with pytest.raises(ConfigError, match=f"server.auth_token_file: .*{why}"):
            start_server(model_dir, {"auth_token_file": str(path)})
    serve = [sys.executable, "-m", "mtpserve", "serve", "--model", str(model_dir), "--load-format", "dummy"]
    serve += ["--device", "cpu", "--port", "0", "--host", "0.0.0.0", "--auth-token-file", str(tmp_path / "absent")]
    proc = subprocess.run(serve, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "server.auth_token_file" in proc.stderr and "cannot read" in proc.stderr
    open_bind = subprocess.run(
        [sys.executable, "-m", "mtpserve", "serve", "--host", "0.0.0.0", "--print-config"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert open_bind.returncode == 2 and "server.host" in open_bind.stderr


def test_tls_flags_reach_the_nested_config(pki: dict[str, Path]) -> None:
    """--tls-cert, --tls-key and --tls-client-ca set server.tls.* (a dotted key two sections deep)."""
    import argparse

    from mtpserve.cluster.cli.cmd_serve import add_serve_flags
    from mtpserve.cluster.cli.common import config_from_args

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(
        [
            "--tls-cert",
            str(pki["server_cert"]),
            "--tls-key",
            str(pki["server_key"]),
            "--tls-client-ca",
            str(pki["client_ca"]),
        ]
    )
    tls = config_from_args(args).server.tls
    assert (tls.cert_file, tls.key_file, tls.client_ca_file) == (
        str(pki["server_cert"]),
        str(pki["server_key"]),
        str(pki["client_ca"]),
    )
