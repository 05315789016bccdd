"""Public servers around one engine loop (cluster/service/engine_loop.py): gRPC (the Inference servicer,
cluster/service/servicer.py, health, reflection) and the optional OpenAI-compatible HTTP API
(cluster/service/http_api.py), both on one front-end thread and event loop, and the metrics endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mtpserve.cluster.service.admission import connection_cap, open_file_limit
from mtpserve.cluster.service.auth import (
    BearerTokenInterceptor,
    metrics_token,
    read_secret,
    server_credentials,
    ssl_context,
)
from mtpserve.cluster.service.engine_loop import EngineLoop
from mtpserve.cluster.service.engine_process import EngineProcess
from mtpserve.cluster.service.front_end_thread import FrontEndThread, HTTPSite
from mtpserve.cluster.service.grpc_handlers import add_inference_servicer
from mtpserve.cluster.service.health import LiveHealth
from mtpserve.cluster.service.http_api import OpenAIAPI
from mtpserve.cluster.service.metrics import GRPC, ServerMetrics
from mtpserve.cluster.service.pool_engines import EngineSlots, connect_engine
from mtpserve.cluster.service.replica_set import connect_replicas, start_replicas
from mtpserve.cluster.service.request_book import EngineCore
from mtpserve.cluster.service.servicer import SERVICE_NAME, InferenceServicer
from mtpserve.workers.config import MTPServeConfig

if TYPE_CHECKING:
    from mtpserve.cluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
STREAM_END_S = 2.0  # after the drain, time for the streams to send their terminal error before the ports close


def raise_open_file_limit() -> None:
    """Lift this process's soft limit on open files to the hard one: each connection holds a file, and past the
    limit the listening sockets cannot accept (health checks included)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def max_rpcs(cfg: MTPServeConfig) -> int:
    """Calls the gRPC server runs at once: every running and queued request, and some room for the rest."""
    return min(cfg.scheduler.max_num_requests + cfg.scheduler.max_queue, 1024) + 16


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MTPServer:
    """The gRPC server (Inference, Health, reflection), the HTTP API when `server.http_port` is set, their
    engine and the metrics endpoint.

    Given an engine, the server drives it from a thread of this process (EngineLoop). Given none, it builds the
    engine from `cfg` in a process of its own (EngineProcess; the build's errors, such as ModelLoadError, are
    raised here; `server.replicas` > 1 such processes behind one `ReplicaSet`), or, given `engine_pipe`, drives the
    engine at the other end of that pipe. One of several front ends on the same ports takes `reuse_port`,
    `engine_metrics` False (another process records those) and the Unix-socket `engines` its engines
    listen at (several: replicas, behind one `ReplicaSet`)."""

    def __init__(
        self,
        engine: LLMEngine | None,
        cfg: MTPServeConfig | None = None,
        metrics: bool = True,
        engine_pipe: Connection | None = None,
        engine_metrics: bool = True,
        reuse_port: bool = False,
        engines: EngineSlots | None = None,
    ) -> None:
        if cfg is None:
            assert engine is not None, "give an engine or a config"
            cfg = engine.cfg
        self.cfg = cfg
        self.engine = engine  # None when the engine runs in a process of its own
        self.metrics = ServerMetrics(engine_wide=engine_metrics)
        self._reuse_port = reuse_port  # other processes serve the same ports
        self._metrics_on = metrics
        self._serving = True
        self.front_end = FrontEndThread()
        self.health = LiveHealth(
            self.is_serving, [SERVICE_NAME], self.front_end.loop, max(2, min(64, max_rpcs(cfg) // 8))
        )
        self.loop: EngineCore
        try:
            if cfg.server.most_replicas > cfg.server.replicas and engines is None:
                raise ValueError("server.max_replicas scales the engines of a FrontEndPool, not of one MTPServer")
            if engines is not None and len(engines.addresses) > 1:
                self.loop = connect_replicas(
                    cfg,
                    engines,
                    self.front_end.loop,
                    self.metrics,
                    on_health_change=lambda _ok: self.health.changed(),
                    on_serving=self.set_serving,
                )
            elif engine is None and engine_pipe is None and engines is None and cfg.server.replicas > 1:
                self.loop = start_replicas(
                    cfg,
                    self.front_end.loop,
                    self.metrics,
                    lambda _ok: self.health.changed(),
                    on_serving=self.set_serving,
                )
            elif engine is None:
                self.loop = EngineProcess(
                    cfg,
                    self.front_end.loop,
                    self.metrics,
                    lambda _ok: self.health.changed(),
                    pipe=connect_engine(engines.addresses[0], 0.0) if engines is not None else engine_pipe,
                    on_serving=self.set_serving,
                )
            else:
                self.loop = EngineLoop(engine, self.metrics, on_health_change=lambda _ok: self.health.changed())
                engine.health_listeners.append(self.set_serving)
        except BaseException:
            self.front_end.stop(None)
            raise
        self.servicer = InferenceServicer(self.loop, self.accepting)
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: HTTPSite | None = None

    @property
    def max_connections(self) -> int:
        """Open connections each port takes (server.max_connections, or derived from the open-file limit)."""
        return connection_cap(self.cfg.server.max_connections, open_file_limit())

    @property
    def address(self) -> str:
        """host:port the gRPC server is bound to."""
        return host_port(self.cfg.server.host, self.port)

    @property
    def http_address(self) -> str | None:
        """host:port the HTTP API is bound to; None when it is off."""
        return None if self.http_port is None else host_port(self.cfg.server.host, self.http_port)

    def accepting(self) -> bool:
        """Whether Generate takes new requests: not stopped, set_serving(False) not in force, loop alive.

        A step that found workers down does not close the door: the next request tries again, and a
        step that succeeds marks the loop healthy again.
        """
        return self._serving and self.loop.running

    def is_serving(self) -> bool:
        """Health SERVING: accepting requests and the last step found every worker up."""
        return self.accepting() and self.loop.healthy

    def set_serving(self, serving: bool) -> None:
        """Hook for the distributed engine: report every actor up (True) or some down (False)."""
        self._serving = serving
        if serving:
            self.loop.mark_healthy()
        self.health.changed()

    def start(self) -> None:
        """Start the engine loop, bind the gRPC port (TLS and the token check as configured), the HTTP port when
        set, and the metrics endpoint; ConfigError when a credential file cannot be read."""
        sc = self.cfg.server
        raise_open_file_limit()
        token = read_secret(sc.auth_token_file, "server.auth_token_file") if sc.auth_token_file else None
        credentials = server_credentials(sc.tls) if sc.tls.enabled else None
        self.loop.start()
        self.front_end.start()
        try:
            self.front_end.call(lambda: self._start_grpc(token, credentials))
            if sc.http_port is not None:
                self._start_http(token)
            if self._metrics_on:
                self.metrics_port = self.metrics.start_http(sc.metrics_port, sc.metrics_host, metrics_token(sc))
        except BaseException:
            self.stop(grace=0.0)
            raise
        if self.metrics.engine is not None:
            self.metrics.engine.set_model(self.loop.info)
        self.health.changed()
        log.info("gRPC on %s, HTTP on %s, metrics on %s", self.address, self.http_address, self.metrics_port)

    async def _start_grpc(self, token: bytes | None, credentials: grpc.ServerCredentials | None) -> None:
        sc = self.cfg.server
        limit = sc.max_message_mb * 1024 * 1024
        tokens = self.loop.info.max_model_len
        receive = min(limit, max(1 << 20, 2 * tokens * max(self.servicer.tokenizers.max_token_bytes, 10)))
        age = (
            []
            if sc.max_connection_age_s is None
            else [("grpc.max_connection_age_ms", int(sc.max_connection_age_s * 1e3))]
        )
        interceptors = []
        if token is not None:
            refused = self.metrics.auth_failures
            interceptors.append(
                BearerTokenInterceptor(token, lambda reason: refused.labels(frontend=GRPC, reason=reason).inc())
            )
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", receive),  # a prompt of max_model_len tokens fits
                ("grpc.so_reuseport", int(self._reuse_port)),
                ("grpc.server_handshake_timeout_ms", int(sc.idle_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(sc.idle_timeout_s * 1000)),
                ("grpc.keepalive_time_ms", 60_000),  # ping a connection with calls: a dead peer ends them
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                *age,
            ],
            maximum_concurrent_rpcs=max_rpcs(self.cfg),
            interceptors=interceptors,
        )
        add_inference_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        bind = host_port(sc.host, sc.port)
        self.port = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
        await server.start()
        self._grpc = server

    def _start_http(self, token: bytes | None) -> None:
        sc = self.cfg.server
        assert sc.http_port is not None
        api = OpenAIAPI(
            self.loop,
            self.servicer.tokenizers,
            self.loop.info.model_name,
            accepting=self.accepting,
            serving=self.is_serving,
            token=token,
            metrics=self.metrics,
            max_body_bytes=sc.http_max_body_mb * 1024 * 1024,
            body_timeout=sc.body_timeout_s,
        )
        tls = ssl_context(sc.tls) if sc.tls.enabled else None
        self._http = HTTPSite(
            api.app,
            sc.host,
            sc.http_port,
            ssl_context=tls,
            reuse_port=self._reuse_port,
            idle_timeout=sc.idle_timeout_s,
            max_connections=self.max_connections,
        )
        self.http_port = self.front_end.call(self._http.start)

    def stop(self, grace: float = 1.0) -> None:
        """Drain, then stop: report NOT_SERVING and refuse new requests at once; let the requests in flight finish
        for up to `grace` s; end the rest with a terminal error (gRPC UNAVAILABLE; over HTTP an `abort` finish, an
        error event and [DONE]); then close the ports and stop the engine side."""
        self._serving = False
        self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace
        while self.loop.running and self.loop.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.loop.in_flight()
        if left:
            log.warning("%d requests still in flight after the %.0f s drain; ending them", left, grace)
        self.loop.stop()  # what is left ends with ServerShuttingDown, which each stream reports to its client
        self.front_end.stop(lambda: self._stop_front_ends(STREAM_END_S), timeout=STREAM_END_S + 10.0)
        self.metrics.stop_http()

    async def _stop_front_ends(self, grace: float) -> None:
        stops = [] if self._grpc is None else [self._grpc.stop(grace)]
        if self._http is not None:
            stops.append(self._http.stop())  # its own grace, 1 s, running beside gRPC's
        await asyncio.gather(*stops)
