"""Command-line flags made from MTPServeConfig's fields, so each setting is written once: every field of a section
becomes `--section.field` (nested ones too: `--server.tls.cert-file`), with the field's type, choices and
description; a few fields also answer to a short name (`--tp`), and a few switches set a field to one value
(`--enforce-eager`). Parsed, each flag's destination is its dotted key."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mtpserve.workers.config import MTPServeConfig

ENGINE_SECTIONS = ("model", "speculative", "scheduler", "parallel")
SERVER_SECTIONS = ("server",)


@dataclass(frozen=True)
class Switch:
    """A flag that sets `key` to `value`."""

    flag: str
    key: str
    value: Any


NAMES = {  # short names of the settings users reach for most
    "model.path": "--model",
    "model.load_format": "--load-format",
    "model.device": "--device",
    "model.dtype": "--dtype",
    "model.max_model_len": "--max-model-len",
    "model.cpu_threads": "--cpu-threads",
    "model.gemv_tiles": "--gemv-tiles",
    "speculative.draft": "--draft",
    "speculative.method": "--spec-method",
    "speculative.num_draft_tokens": "--num-draft-tokens",
    "speculative.tree_budget": "--spec-tree-budget",
    "speculative.tree_width": "--spec-tree-width",
    "speculative.adaptive": "--spec-adaptive",
    "speculative.lookahead_source": "--lookahead-source",
    "scheduler.chunk_size": "--chunk-size",
    "scheduler.max_num_batched_tokens": "--max-num-batched-tokens",
    "scheduler.max_num_requests": "--max-num-requests",
    "scheduler.num_kv_blocks": "--num-kv-blocks",
    "scheduler.prefix_caching": "--prefix-caching",
    "parallel.tp_size": "--tp",
    "parallel.draft_placement": "--draft-placement",
    "parallel.distributed": "--distributed",
    "parallel.ray_address": "--address",
    "server.host": "--host",
    "server.port": "--port",
    "server.metrics_port": "--metrics-port",
    "server.metrics_host": "--metrics-host",
    "server.http_port": "--http-port",
    "server.frontends": "--frontends",
    "server.replicas": "--replicas",
    "server.max_replicas": "--max-replicas",
    "server.routing": "--routing",
    "server.engine_process": "--engine-process",
    "server.auth_token_file": "--auth-token-file",
    "server.allow_insecure": "--allow-insecure",
    "server.tls.cert_file": "--tls-cert",
    "server.tls.key_file": "--tls-key",
    "server.tls.client_ca_file": "--tls-client-ca",
}

SWITCHES = (
    Switch("--enforce-eager", "model.cuda_graphs", False),
    Switch("--no-overlap", "model.overlap_steps", False),
    Switch("--no-overlap-speculative", "model.overlap_speculative", False),
    Switch("--no-fused-kernels", "model.fused_kernels", False),
    Switch("--no-prefill-graphs", "model.prefill_graphs", False),
    Switch("--no-pdl", "model.pdl", False),
    Switch("--no-speculation", "speculative.enabled", False),
)


@dataclass(frozen=True)
class Setting:
    """One leaf field of the config: its dotted key, value type, choices and description."""

    key: str
    kind: type
    choices: tuple[Any, ...] | None
    info: FieldInfo

    @property
    def flag(self) -> str:
        """The flag made from the key: --section.field-name."""
        return "--" + self.key.replace("_", "-")


def settings(sections: tuple[str, ...]) -> list[Setting]:
    """Every leaf field under `sections` of MTPServeConfig, nested sections included."""
    out: list[Setting] = []
    for name in sections:
        section = MTPServeConfig.model_fields[name].annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        _collect(section, name, out)
    return out


def _collect(model: type[BaseModel], prefix: str, out: list[Setting]) -> None:
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}"
        inner = _without_none(info.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            _collect(inner, key, out)
        elif typing.get_origin(inner) is Literal:
            choices = typing.get_args(inner)
            out.append(Setting(key, type(choices[0]), choices, info))
        else:
            assert inner in (bool, int, float, str), f"{key}: no flag for {inner}"
            out.append(Setting(key, inner, None, info))


def _without_none(annotation: Any) -> Any:
    """`X` of `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _help(s: Setting) -> str:
    text = s.info.description or ""
    default = s.info.get_default(call_default_factory=False)
    if default is not None and not isinstance(default, BaseModel) and s.kind is not bool:
        text += f" (default {default})"
    elif s.kind is bool:
        text += f" (default {'on' if default else 'off'})"
    return text.replace("%", "%%")


def add_config_flags(p: argparse.ArgumentParser, sections: tuple[str, ...]) -> None:
    """A flag for every setting of `sections`, grouped by section, plus their short names and switches."""
    groups: dict[str, Any] = {}
    for s in settings(sections):
        section = s.key.split(".")[0]
        if section not in groups:
            groups[section] = p.add_argument_group(f"config: {section}")
        names = [n for n in (NAMES.get(s.key), s.flag) if n]
        kw: dict[str, Any] = {"dest": s.key, "default": None, "help": _help(s)}
        if s.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"], kw["metavar"] = s.kind, s.key.rsplit(".", 1)[1].upper()
            if s.choices:
                kw["choices"], kw["metavar"] = s.choices, None
        groups[section].add_argument(*names, **kw)
    for sw in SWITCHES:
        if sw.key.split(".")[0] in sections:
            groups[sw.key.split(".")[0]].add_argument(
                sw.flag,
                dest=sw.key,
                action="store_const",
                const=sw.value,
                default=None,
                help=f"sets {sw.key} to {str(sw.value).lower()} (see --{sw.key.replace('_', '-')})",
            )


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted-key overrides the parsed flags name (flags not given are left out)."""
    return {k: v for k, v in vars(args).items() if "." in k and v is not None}
