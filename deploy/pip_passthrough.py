"""This machine's pip settings as image build arguments, plus the local files they name, to mount read-only.

An image build runs pip inside the image, where the machine's pip.conf and PIP_* variables do not reach.
`python -m mtpserve.deploy.pip_passthrough` prints what `buildah bud` (or `docker build`) needs so that `pip install`
in the image sees the same indexes, wheel folders, constraints and CA bundle as `pip install` here: one
`--build-arg=PIP_NAME=value` per setting that pip has here, and one `--volume=PATH:PATH:ro` per local folder
or file those settings point at (file:// indexes, find-links folders, the constraints file, the CA bundle).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

# The pip settings that decide where packages come from; deploy/docker/Dockerfile declares each as an ARG.
SETTINGS = ("index-url", "extra-index-url", "find-links", "trusted-host", "constraint", "cert", "default-timeout")
INDEX_SETTINGS = ("index-url", "extra-index-url")
NOT_PATHS = ("trusted-host", "default-timeout")
_LINE = re.compile(r"(?P<section>:env:|[\w-]+)\.(?P<key>[\w-]+)=(?P<value>'.*'|\".*\")")


def env_name(setting: str) -> str:
    """The PIP_* variable (and build argument) of a pip setting: extra-index-url -> PIP_EXTRA_INDEX_URL."""
    return "PIP_" + setting.upper().replace("-", "_")


def parse_config_list(text: str) -> dict[str, dict[str, str]]:
    """`pip config list` output as {section: {setting: value}}; environment variables form section ':env:'."""
    sections: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = _LINE.fullmatch(line.strip())
        if match:
            sections.setdefault(match["section"], {})[match["key"]] = str(ast.literal_eval(match["value"]))
    return sections


def effective_settings(sections: Mapping[str, Mapping[str, str]], environ: Mapping[str, str]) -> dict[str, str]:
    """{PIP_NAME: value} of each setting `pip install` uses: PIP_* variables over [install] over [global]."""
    out: dict[str, str] = {}
    for setting in SETTINGS:
        sources = (environ, sections.get(":env:", {}), sections.get("install", {}), sections.get("global", {}))
        keys = (env_name(setting), setting, setting, setting)
        for source, key in zip(sources, keys, strict=True):
            value = source.get(key, "").strip()
            if value:
                out[env_name(setting)] = value
                break
    return out


def _local_path(word: str) -> Path | None:
    """The local path of a file:// URL or an absolute path; None for anything remote."""
    if word.startswith("file:"):
        return Path(unquote(urlparse(word).path))
    return Path(word) if word.startswith("/") else None


def local_paths(settings: Mapping[str, str]) -> list[Path]:
    """Existing local files and folders that the settings name, outermost only.

    A file:// index counts from its parent folder, since index pages link to files beside the index
    (e.g. /opt/pypi/simple/torch/ -> ../../files/torch-...whl).
    """
    found: list[Path] = []
    for setting in SETTINGS:
        if setting in NOT_PATHS:
            continue
        for word in settings.get(env_name(setting), "").split():
            path = _local_path(word)
            if path is None:
                continue
            path = Path(os.path.normpath(path))  # as named: pip in the image reads this path
            if setting in INDEX_SETTINGS:
                path = path.parent
            if path.exists():
                found.append(path)
    unique = sorted(set(found))
    return [p for p in unique if not any(q != p and q in p.parents for q in unique)]


def build_arguments(settings: Mapping[str, str], paths: Iterable[Path]) -> list[str]:
    """`buildah bud` arguments: a --build-arg per setting, a read-only --volume per local path."""
    args = [f"--build-arg={name}={value}" for name, value in settings.items()]
    args += [f"--volume={p}:{p}:ro" for p in paths]
    return args


def pip_config_list(python: str = sys.executable) -> str:
    """`pip config list` of an interpreter ('' when it has no pip)."""
    try:
        done = subprocess.run(
            [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError:
        return ""
    return done.stdout if done.returncode == 0 else ""


def main() -> int:
    """Print the build arguments for this interpreter's pip settings, one a line."""
    settings = effective_settings(parse_config_list(pip_config_list()), os.environ)
    for arg in build_arguments(settings, local_paths(settings)):
        print(arg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
