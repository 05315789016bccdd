"""Every config field is a flag of `mtpserve serve` (made from the field, so the setting is written once), and
every flag, by its dotted name, its short name or as a switch, lands in the config at its key."""

from __future__ import annotations

import argparse
from typing import Any

import annotated_types as at
import pytest

from mtpserve.cluster.cli.common import config_from_args
from mtpserve.cluster.cli.config_flags import (
    ENGINE_SECTIONS,
    NAMES,
    SERVER_SECTIONS,
    SWITCHES,
    Setting,
    settings,
)
from mtpserve.cluster.cli.mtpserve import build_parser
from mtpserve.workers.config import MTPServeConfig

ALL = settings(SERVER_SECTIONS + ENGINE_SECTIONS)
STRINGS = {  # values a string field accepts alone
    "server.host": "localhost",
    "server.metrics_host": "0.0.0.0",
    "model.gemv_tiles": "default",
    "speculative.draft": "random",
}
INTS = {"scheduler.max_num_batched_tokens": 4096}
COMPANIONS = {  # settings that other validation ties to another one
    "server.tls.cert_file": ["--tls-key", "k.pem"],
    "server.tls.key_file": ["--tls-cert", "c.pem"],
    "server.tls.client_ca_file": ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
    "speculative.draft_vocab": ["--draft", "random"],
}


def value_at(cfg: MTPServeConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def bound(s: Setting, kind: type) -> Any:
    for m in s.info.metadata:
        if isinstance(m, kind):
            return getattr(m, kind.__name__.lower())
    return None


def sample(s: Setting) -> tuple[list[str], Any]:
    """(the flag's arguments after its name, the value the config should then hold), unlike the default."""
    default = s.info.get_default(call_default_factory=True)
    if s.kind is bool:
        return [], not default
    if s.choices:
        choice = next(c for c in s.choices if c != default)
        return [str(choice)], choice
    if s.kind is int:
        value = INTS.get(s.key)
        if value is None:
            low = bound(s, at.Ge) if bound(s, at.Ge) is not None else (bound(s, at.Gt) or 0) + 1
            high = bound(s, at.Le)
            value = low + 1 if high is None or low + 1 <= high else low
            value = value if value != default else value + 1
        return [str(value)], value
    if s.kind is float:
        value = (default or 1.0) * 2.5
        return [str(value)], value
    value = STRINGS.get(s.key, f"some-{s.key.rsplit('.', 1)[1]}")
    return [value], value


def parse(argv: list[str]) -> MTPServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def bool_flag(name: str, value: bool) -> str:
    return name if value else "--no-" + name[2:]


@pytest.mark.parametrize("s", ALL, ids=lambda s: s.key)
def test_every_setting_round_trips_by_each_of_its_names(s: Setting) -> None:
    rest, want = sample(s)
    for name in [n for n in (s.flag, NAMES.get(s.key)) if n]:
        flag = bool_flag(name, want) if s.kind is bool else name
        cfg = parse([flag, *rest, *COMPANIONS.get(s.key, [])])
        assert value_at(cfg, s.key) == want, (flag, rest)


def test_switches_set_their_value_and_names_name_real_settings() -> None:
    keys = {s.key for s in ALL}
    assert set(NAMES) <= keys and {sw.key for sw in SWITCHES} <= keys
    for sw in SWITCHES:
        assert value_at(parse([sw.flag]), sw.key) == sw.value
        assert value_at(parse([]), sw.key) != sw.value


def test_every_field_has_a_flag_with_its_description() -> None:
    def leaves(model: Any, prefix: str) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                out += leaves(ann, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    dests = {a.dest: a for a in serve._actions if not isinstance(a, argparse._StoreConstAction)}
    for key in leaves(MTPServeConfig, ""):
        assert key in dests, f"{key} has no flag"
        assert dests[key].help and len(dests[key].help) > 15, f"{key}: no description"
    assert parse([]) == MTPServeConfig()  # no flag given: nothing overridden


def test_a_bad_value_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--server.max-connections", "0"])
    assert "server.max_connections" in capsys.readouterr().err
