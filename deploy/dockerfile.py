"""What an image promises its runtime (ports, labels, user), read from a Dockerfile or from a built image's config."""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction; continuation lines joined; comment and blank lines
    dropped, inside a continuation too (as Docker does)."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            word, _, rest = whole.partition(" ")
            yield word.upper(), rest.strip()
    if pending.strip():
        word, _, rest = pending.strip().partition(" ")
        yield word.upper(), rest.strip()


def labels(text: str) -> dict[str, str]:
    """key -> value of every LABEL key=value pair (quotes removed; a later label wins)."""
    out: dict[str, str] = {}
    for word, rest in instructions(text):
        if word == "LABEL":
            for pair in shlex.split(rest):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"LABEL {rest!r}: {pair!r} is not key=value")
                out[key] = value
    return out


def final_user(text: str) -> str | None:
    """The argument of the last USER instruction (None: the base image's user)."""
    users = [rest for word, rest in instructions(text) if word == "USER"]
    return users[-1] if users else None


@dataclass
class ImageFacts:
    """The parts of an image's config that a deployment relies on."""

    ports: set[int] = field(default_factory=set)  # exposed TCP/UDP port numbers
    labels: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # "uid[:gid]" or a name; None when unset

    @classmethod
    def from_dockerfile(cls, text: str) -> ImageFacts:
        """The facts a Dockerfile sets (EXPOSE, LABEL, USER)."""
        ports = {int(w.split("/")[0]) for word, rest in instructions(text) if word == "EXPOSE" for w in rest.split()}
        return cls(ports, labels(text), final_user(text))

    @classmethod
    def from_oci_config(cls, config: Mapping[str, Any]) -> ImageFacts:
        """The facts of a built image, from its OCI config (`buildah inspect`'s OCIv1.config)."""
        ports = {int(str(p).split("/")[0]) for p in config.get("ExposedPorts") or {}}
        return cls(ports, dict(config.get("Labels") or {}), config.get("User") or None)

    def uid(self) -> int | None:
        """The numeric uid the image runs as (None when unset or given as a name)."""
        head = (self.user or "").split(":")[0]
        return int(head) if head.isdigit() else None
