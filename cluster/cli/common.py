"""Flags shared by sub-commands and their mapping onto MTPServeConfig."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from mtpserve.cluster.cli.config_flags import ENGINE_SECTIONS, add_config_flags, overrides_from
from mtpserve.workers.config import MTPServeConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--config and the model, speculation, scheduling and parallelism flags (serve, generate --local, bench)."""
    p.add_argument("--config", help="YAML config file; the flags below override it")
    add_config_flags(p, ENGINE_SECTIONS)


def config_from_args(args: argparse.Namespace) -> MTPServeConfig:
    """Merge --config YAML with flag overrides; exits with a field-named message on bad values."""
    a = vars(args)
    overrides = overrides_from(args)
    try:
        if a.get("config"):
            return MTPServeConfig.from_yaml(a["config"], overrides)
        return MTPServeConfig.from_dict({}, overrides)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            print(f"mtpserve: invalid config: {loc}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
    except (OSError, ValueError) as exc:
        print(f"mtpserve: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
