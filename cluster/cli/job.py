"""Ray job entrypoint: `ray job submit --working-dir . -- python -m mtpserve.cluster.job [serve flags]`.

It joins the Ray cluster the job runs in (the job supervisor sets RAY_ADDRESS), serves the gRPC API
exactly as `mtpserve serve` does, and exits cleanly on the SIGTERM that `ray job stop` sends.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from mtpserve.cluster.cli.cmd_serve import add_serve_flags, print_config, serve
from mtpserve.cluster.cli.common import config_from_args
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger("mtpserve.cluster.job")
JOB_ENV_VARS = ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")
STOP_WAIT_VAR = "RAY_JOB_STOP_WAIT_TIME_S"  # read by Ray's job supervisor from the job's runtime env
RAY_STOP_WAIT_S = 3.0  # Ray's default time between `ray job stop`'s SIGTERM and its SIGKILL
SHUTDOWN_S = 15.0  # after the drain: the scheduler actor, its workers and Ray to stop


def in_ray_job() -> bool:
    """True when started by a Ray job supervisor or pointed at a cluster through RAY_ADDRESS."""
    return any(os.environ.get(name) for name in JOB_ENV_VARS)


def ray_address(cfg: MTPServeConfig) -> str | None:
    """--address if given; inside a job the job's cluster (RAY_ADDRESS, else 'auto'); else None (local)."""
    if cfg.parallel.ray_address:
        return cfg.parallel.ray_address
    if in_ray_job():
        return os.environ.get("RAY_ADDRESS") or "auto"
    return None


def connect_ray(cfg: MTPServeConfig) -> None:
    """ray.init on the job's cluster (or a new local one) and record the address in cfg for the actors."""
    import ray

    address = ray_address(cfg)
    ray.init(address=address, namespace="mtpserve", ignore_reinit_error=True)
    cfg.parallel.ray_address = address or ray.get_runtime_context().gcs_address
    log.info("connected to Ray %s at %s (python %s)", ray.__version__, cfg.parallel.ray_address, sys.executable)


def stop_wait_warning(cfg: MTPServeConfig) -> str | None:
    """Inside a Ray job: a warning when `ray job stop` would kill the server before its drain ends (the streams in
    flight would be cut), with the setting that fixes it; else None."""
    if not in_ray_job():
        return None
    try:
        wait = float(os.environ.get(STOP_WAIT_VAR, RAY_STOP_WAIT_S))
    except ValueError:
        wait = RAY_STOP_WAIT_S
    drain = cfg.server.drain_timeout_s
    need = math.ceil(drain + SHUTDOWN_S)
    if wait >= need:
        return None
    env = json.dumps({"env_vars": {STOP_WAIT_VAR: str(need)}})
    return (
        f"`ray job stop` kills this job {wait:g} s after its SIGTERM ({STOP_WAIT_VAR}), before the {drain:g} s drain "
        f"(server.drain_timeout_s) ends the streams in flight; submit with --runtime-env-json '{env}'"
    )


def build_parser() -> argparse.ArgumentParser:
    """The job's flags: the same as `mtpserve serve`."""
    p = argparse.ArgumentParser(
        prog="python -m mtpserve.cluster.job",
        description="Ray job entrypoint: serve mtpserve's gRPC API inside the job's Ray cluster until `ray job stop`.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_serve_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, connect to Ray, serve until SIGTERM/SIGINT, disconnect."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    cfg = config_from_args(args)
    if args.print_config:
        print_config(cfg)
        return 0
    warning = stop_wait_warning(cfg)
    if warning:
        log.warning(warning)
    connect_ray(cfg)
    import ray

    try:
        return serve(cfg)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
