"""Who may call the public gRPC and HTTP APIs: TLS credentials and a bearer-token check.

The token check covers every method except grpc.health.v1 (Kubernetes probes cannot send a token).
A call without `authorization: Bearer <token>` metadata, or with another token, ends with UNAUTHENTICATED
and is counted. TLS handshake failures (no client certificate under mutual TLS, an untrusted CA) are
refused by the transport before any method runs. The HTTP API (cluster/service/http_api.py) checks the same
token, and serves TLS from the same files through `ssl_context`.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mtpserve.cluster.engine.errors import ConfigError
from mtpserve.workers.config import ServerConfig, TLSConfig

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_HEADER = "authorization"


def read_secret(path: str, field: str) -> bytes:
    """The bytes of a credential file, stripped; ConfigError naming `field` when missing or empty."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(field, f"cannot read '{path}': {exc.strerror or exc}") from None
    if not data:
        raise ConfigError(field, f"'{path}' is empty")
    return data


def metrics_token(sc: ServerConfig) -> bytes | None:
    """The token /metrics requires (server.metrics_auth_token_file), or None when it is open."""
    if sc.metrics_auth_token_file is None:
        return None
    return read_secret(sc.metrics_auth_token_file, "server.metrics_auth_token_file")


def check_server_files(sc: ServerConfig) -> None:
    """Read every configured credential file once, so that a bad path fails before the model loads."""
    if sc.auth_token_file is not None:
        read_secret(sc.auth_token_file, "server.auth_token_file")
    metrics_token(sc)
    if sc.tls.enabled:
        server_credentials(sc.tls)
        if sc.http_port is not None:
            ssl_context(sc.tls)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """gRPC server credentials from the TLS config (client certificates required when a CA is set)."""
    assert tls.cert_file is not None and tls.key_file is not None
    key = read_secret(tls.key_file, "server.tls.key_file")
    cert = read_secret(tls.cert_file, "server.tls.cert_file")
    ca = read_secret(tls.client_ca_file, "server.tls.client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """A server-side TLS context from the TLS config (client certificates required when a CA is set);
    ConfigError naming the field whose file does not load."""
    assert tls.cert_file is not None and tls.key_file is not None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(Path(tls.cert_file).expanduser(), Path(tls.key_file).expanduser())
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("server.tls.cert_file", f"cannot load it with server.tls.key_file: {exc}") from None
    if tls.client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=Path(tls.client_ca_file).expanduser())
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("server.tls.client_ca_file", f"cannot load it: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def bearer(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` entry of call metadata (or HTTP headers), if any."""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _refuse(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends calls without the expected bearer token with UNAUTHENTICATED; `on_failure(reason)` counts them
    (reason: "missing" or "invalid")."""

    def __init__(self, token: bytes, on_failure: Callable[[str], None]) -> None:
        self._token = token
        self._on_failure = on_failure

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        """Pass health checks and calls with the right token; refuse the rest."""
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        token = bearer(handler_call_details.invocation_metadata)
        if token is None:
            self._on_failure("missing")
            return _refuse(handler, "missing bearer token: send metadata 'authorization: Bearer <token>'")
        if not hmac.compare_digest(token.encode(), self._token):
            self._on_failure("invalid")
            return _refuse(handler, "invalid bearer token")
        return handler
