"""The Prometheus endpoint: /metrics of a registry on its own port, served from a thread, behind a bearer token
when one is configured (server.metrics_auth_token_file)."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def _with_token(app: Callable[..., Iterable[bytes]], token: bytes) -> Callable[..., Iterable[bytes]]:
    want = b"Bearer " + token

    def check(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        got = environ.get("HTTP_AUTHORIZATION", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, want):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required (server.metrics_auth_token_file)\n"]
        return app(environ, start_response)

    return check


class MetricsEndpoint:
    """`registry` served at http://host:port/metrics (port 0 picks a free one) until `stop`."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str, token: bytes | None = None) -> None:
        app = make_wsgi_app(registry)
        self._server = make_server(
            host,
            port,
            app if token is None else _with_token(app, token),
            server_class=_ThreadingServer,
            handler_class=_QuietHandler,
        )
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="mtpserve-metrics", daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        """The address the port is bound to."""
        return str(self._server.server_address[0])

    def stop(self) -> None:
        """Stop serving and close the port."""
        self._server.shutdown()
        self._server.server_close()
