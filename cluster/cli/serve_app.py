"""`mtpserve serve` as a Ray Serve application: what the KubeRay RayService manifest runs
(`deploy/k8s/overlays/rayservice`, `import_path: mtpserve.cluster.cli.serve_app:app`).

One deployment replica runs the server through Ray with the `serve` flags of the application's args (`argv`),
exactly as the Ray job entry point does (`cluster/cli/job.py`): its scheduler actor (or replica actors) on the
replica's node, the gRPC and HTTP APIs on their own ports there. With `endpoint_resource` the replica is placed
on the node that offers that custom resource (the head pod in the manifest), where the Kubernetes Service points.
Serve's part is the lifecycle a long-running service needs and a RayJob lacks: RayService starts the application
once the cluster is up, asks its health every few seconds (the server still running and its gRPC port
answering), replaces a replica that fails, and upgrades by bringing up a new cluster before dropping the old.
Serve's own HTTP route (`GET /mtpserve`) says where the APIs are."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from mtpserve.cluster.cli.cmd_serve import serve as serve_until
from mtpserve.cluster.cli.common import config_from_args
from mtpserve.cluster.cli.job import build_parser
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # model load, worker actors and CUDA graphs, before the replica counts as up
PROBE_TIMEOUT_S = 2.0


def config_of(argv: list[str]) -> MTPServeConfig:
    """The server config of `serve` flags, joined to this Ray cluster; ValueError naming the problem."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        raise ValueError(f"args.argv: not valid `mtpserve serve` flags: {argv}") from None
    try:
        cfg = config_from_args(args)
    except SystemExit:  # config_from_args printed the field and the reason
        raise ValueError("args.argv: the flags give an invalid config (the replica's log names the field)") from None
    if cfg.server.port == 0:
        raise ValueError("args.argv: give --port (the Kubernetes Service needs a fixed gRPC port, not 0)")
    cfg.parallel.ray_address = ray.get_runtime_context().gcs_address
    return cfg


def port_answers(host: str, port: int) -> bool:
    """True when something accepts TCP connections on host:port (0.0.0.0 and :: probed on loopback)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host.strip("[]")
    try:
        with socket.create_connection((target, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


class MTPServeReplica:
    """Runs `serve` on a thread of this Serve replica until the replica is shut down (see the module docstring)."""

    def __init__(self, argv: list[str]) -> None:
        self._stop = threading.Event()
        self._started = False
        self.cfg = config_of(argv)
        self._rc: int | None = None
        self._thread = threading.Thread(target=self._serve, name="mtpserve-serve", daemon=True)
        self._thread.start()
        self._started = True
        sc = self.cfg.server
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_answers(sc.host, sc.port):
            if not self._thread.is_alive():
                raise RuntimeError(f"mtpserve serve exited with status {self._rc} before serving (see the log)")
            if time.monotonic() > deadline:
                self._stop.set()
                raise TimeoutError(f"mtpserve serve did not open port {sc.port} within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        log.info("mtpserve serves gRPC on %s:%d", sc.host, sc.port)

    def _serve(self) -> None:
        self._rc = serve_until(self.cfg, self._stop)

    def endpoints(self) -> dict[str, Any]:
        """Where the APIs are, and whether the server still runs."""
        sc = self.cfg.server
        http = None if sc.http_port is None else f"{sc.host}:{sc.http_port}"
        return {"grpc": f"{sc.host}:{sc.port}", "http": http, "serving": self._thread.is_alive()}

    async def __call__(self, request: Any) -> dict[str, Any]:
        """Serve's HTTP route: `endpoints()`."""
        return self.endpoints()

    def check_health(self) -> None:
        """Raise while the server is not serving: Serve then replaces this replica."""
        if not self._thread.is_alive():
            raise RuntimeError(f"mtpserve serve exited with status {self._rc}")
        if not port_answers(self.cfg.server.host, self.cfg.server.port):
            raise RuntimeError(f"the gRPC port {self.cfg.server.port} does not answer")

    def __del__(self) -> None:
        """Stop the server (its streams drain first) when Serve shuts the replica down."""
        self._stop.set()
        if self._started:
            with contextlib.suppress(Exception):
                self._thread.join(self.cfg.server.drain_timeout_s + 30.0)


MTPServeDeployment = serve.deployment(num_replicas=1, health_check_period_s=10, health_check_timeout_s=30)(
    MTPServeReplica
)


def app(args: dict[str, Any]) -> Application:
    """The application serveConfigV2 names. `args.argv`: the `serve` flags (a list of strings); optional
    `args.endpoint_resource`: a custom resource the replica's node must offer (where the Service points)."""
    argv = args.get("argv", [])
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"args.argv must be a list of strings, got {argv!r}")
    resource = args.get("endpoint_resource")
    options: dict[str, Any] = {"num_cpus": 0}
    if resource is not None:
        if not isinstance(resource, str) or not resource:
            raise ValueError(f"args.endpoint_resource must be a resource name, got {resource!r}")
        options["resources"] = {resource: 0.001}
    return MTPServeDeployment.options(ray_actor_options=options).bind(argv)
