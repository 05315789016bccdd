"""The Grafana dashboard under deploy/grafana names only metrics the server exports, with labels they carry."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from mtpserve.cluster.service.metrics import EngineMetrics, ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mtpserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> dict[str, set[str]]:
    """Every series name a server exports, with the labels it carries."""
    registries = [ServerMetrics().registry, CollectorRegistry()]
    EngineMetrics(registries[1])
    names: dict[str, set[str]] = {}
    for registry in registries:
        for collector in set(registry._names_to_collectors.values()):
            labels = set(getattr(collector, "_labelnames", ()))
            for family in collector.describe():  # type: ignore[attr-defined]
                for suffix in SUFFIXES[family.type]:
                    names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def test_every_panel_names_exported_metrics_and_labels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    have = exported()
    assert "mtpserve_inter_token_latency_seconds_bucket" in have and "mtpserve_requests_total" in have
    exprs = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    problems = []
    for title, expr, legend in exprs:
        used = set(re.findall(r"\bmtpserve_[a-z0-9_]+", expr))
        assert used, f"{title}: no mtpserve metric in {expr!r}"
        for name in used - set(have):
            problems.append(f"{title}: {name} is not exported")
        labels = set(re.findall(r"by \(([^)]*)\)", expr)) | set(re.findall(r"\{\{(\w+)\}\}", legend))
        for group in labels:
            for label in (x.strip() for x in group.split(",")):
                if label and not any(label in have[n] for n in used if n in have):
                    problems.append(f"{title}: no metric in {expr!r} carries the label {label!r}")
    assert not problems, "\n".join(problems)


def test_panels_do_not_overlap() -> None:
    cells = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
