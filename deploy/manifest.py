"""Shared helpers for reading manifests: the repository root, JSON paths and the pod templates of Ray kinds."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mtpserve.deploy.render import Doc

REPO_ROOT = Path(__file__).resolve().parent.parent


def json_path(parts: Iterable[Any]) -> str:
    """Render a path such as ["spec", "ports", 0, "nvidia.com/gpu"] as $.spec.ports[0]['nvidia.com/gpu']."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_$][\w$-]*", str(part)):
            out += f".{part}"
        else:
            out += f"[{str(part)!r}]"
    return out


def pod_templates(doc: Doc) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """(path, template) of every pod template inside a RayCluster, RayJob or RayService."""
    spec = doc.get("spec") or {}
    prefix: list[Any] = ["spec"]
    if doc.get("kind") == "RayJob":
        if isinstance(spec.get("submitterPodTemplate"), dict):
            yield ["spec", "submitterPodTemplate"], spec["submitterPodTemplate"]
        spec, prefix = spec.get("rayClusterSpec") or {}, ["spec", "rayClusterSpec"]
    elif doc.get("kind") == "RayService":
        spec, prefix = spec.get("rayClusterConfig") or {}, ["spec", "rayClusterConfig"]
    head = spec.get("headGroupSpec") or {}
    if isinstance(head.get("template"), dict):
        yield [*prefix, "headGroupSpec", "template"], head["template"]
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        if isinstance(group, dict) and isinstance(group.get("template"), dict):
            yield [*prefix, "workerGroupSpecs", i, "template"], group["template"]
