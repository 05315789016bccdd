"""Validate Kubernetes manifests offline and report every error with its JSON path.

- RayCluster, RayJob and RayService (ray.io/v1): KubeRay's CRD OpenAPI schemas, read from the folder in
  ``$MTPSERVE_KUBERAY_CRDS`` (default ``../shared/kuberay-crds`` from the repository root).
  Unknown fields are errors, as with ``kubectl apply``'s strict field validation.
- Built-in kinds, and every pod template inside a Ray resource: the Kubernetes schemas
  bundled with ``kubernetes-validate`` (strict mode). It reports one error per object.
- PodMonitor: a minimal structural check; the Prometheus Operator CRD is not vendored.

CLI: ``python -m mtpserve.deploy.validate deploy/k8s/overlays/gpu [more dirs or files]`` validates the
rendered objects and, for a kustomization, checks them against each other
(mtpserve.deploy.consistency). The exit status is 1 when anything is wrong.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from mtpserve.deploy.consistency import DOCKERFILE, check_consistency
from mtpserve.deploy.manifest import REPO_ROOT, json_path, pod_templates
from mtpserve.deploy.render import Doc, RenderError, find_kustomization, load_docs, render

CRD_ENV = "MTPSERVE_KUBERAY_CRDS"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
K8S_VERSION = "1.32"


def crd_dir() -> Path:
    """Folder holding KubeRay's CRD files: $MTPSERVE_KUBERAY_CRDS, relative to the repo root if relative."""
    path = Path(os.environ.get(CRD_ENV, "../shared/kuberay-crds"))
    return path if path.is_absolute() else (REPO_ROOT / path).resolve()


def _strict(schema: Any) -> Any:
    """Forbid unknown fields wherever the schema lists its properties and does not allow extras."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and not open_:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=8)
def crd_schema(kind: str, folder: str) -> dict[str, Any]:
    """The strict openAPIV3Schema of a KubeRay kind's v1 version."""
    path = Path(folder) / CRD_FILES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; set {CRD_ENV} to the folder with KubeRay's CRDs")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        crd = yaml.load(f, Loader=loader)
    for version in crd["spec"]["versions"]:
        if version["name"] == "v1":
            return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    raise ValueError(f"{path}: no v1 version")


def _schema_errors(doc: Doc, schema: dict[str, Any]) -> Iterator[str]:
    validator = jsonschema.Draft7Validator(schema)
    for err in sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
        path = list(err.absolute_path)
        if err.validator == "required":
            match = re.match(r"'(.+)' is a required property", err.message)
            yield f"{json_path([*path, match.group(1) if match else '?'])}: required field is missing"
        elif err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = set(err.schema.get("properties", {}))
            for extra in sorted(set(err.instance) - known):
                yield f"{json_path([*path, extra])}: unknown field"
        else:
            yield f"{json_path(path)}: {err.message}"


def _k8s_errors(doc: Doc, prefix: list[Any]) -> list[str]:
    """Validate a built-in kind with kubernetes-validate (or a minimal check without it)."""
    try:
        import kubernetes_validate as kv
    except ImportError:  # pragma: no cover - the dev extras install it
        return _minimal_core_errors(doc, prefix)
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as err:
        return [f"{json_path([*prefix, *err.path])}: {err.message}"]
    except kv.SchemaNotFoundError as err:
        return [f"{json_path(prefix)}: {err.message}"]
    return []


def _minimal_core_errors(doc: Doc, prefix: list[Any]) -> list[str]:
    spec = doc.get("spec", doc.get("template", {}))
    return [] if isinstance(spec, dict) else [f"{json_path([*prefix, 'spec'])}: must be a mapping"]


def _pod_monitor_errors(doc: Doc) -> Iterator[str]:
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        yield f"{json_path(['spec'])}: required mapping is missing"
        return
    labels = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        yield f"{json_path(['spec', 'selector', 'matchLabels'])}: must map label names to strings"
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        yield f"{json_path(['spec', 'podMetricsEndpoints'])}: must be a non-empty list"
        return
    for i, ep in enumerate(endpoints):
        where = ["spec", "podMetricsEndpoints", i]
        if not isinstance(ep, dict) or not isinstance(ep.get("port"), str):
            yield f"{json_path([*where, 'port'])}: must name a container port (string)"
        elif "path" in ep and not str(ep["path"]).startswith("/"):
            yield f"{json_path([*where, 'path'])}: must start with '/'"


def validate_manifest(doc: Any, crds: str | Path | None = None) -> list[str]:
    """Every schema error of one manifest, each as '<Kind>/<name>: <JSON path>: <reason>'."""
    if not isinstance(doc, dict):
        return [f"?: $: a manifest must be a mapping, got {type(doc).__name__}"]
    raw_meta = doc.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    label = f"{doc.get('kind', '?')}/{meta.get('name', '?')}"
    errors: list[str] = []
    for field in ("apiVersion", "kind"):
        if not isinstance(doc.get(field), str):
            errors.append(f"{json_path([field])}: required string is missing")
    if not isinstance(meta.get("name"), str):
        errors.append(f"{json_path(['metadata', 'name'])}: required string is missing")
    if errors:
        return [f"{label}: {e}" for e in errors]

    group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
    if group == "ray.io" and doc["kind"] in CRD_FILES:
        folder = str(Path(crds) if crds is not None else crd_dir())
        errors.extend(_schema_errors(doc, crd_schema(doc["kind"], folder)))
        for path, template in pod_templates(doc):
            wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
            found = _k8s_errors({**wrapper, "template": template}, [])
            errors.extend(e.replace("$.template", json_path(path), 1) for e in found)
    elif group == "monitoring.coreos.com" and doc["kind"] == "PodMonitor":
        errors.extend(_pod_monitor_errors(doc))
    else:
        errors.extend(_k8s_errors(doc, []))
    return [f"{label}: {e}" for e in dict.fromkeys(errors)]  # both schemas may flag one field


def load_target(path: str | Path) -> list[Doc]:
    """Objects of a kustomization directory (rendered) or of a YAML file."""
    path = Path(path)
    if path.is_dir() or path.name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        return render(path if path.is_dir() else path.parent)
    return list(load_docs(path))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints errors and returns 1 if there are any."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m mtpserve.deploy.validate DIR_OR_FILE [...]", file=sys.stderr)
        return 2
    failed = False
    for target in args:
        try:
            docs = load_target(target)
        except (OSError, RenderError, yaml.YAMLError) as exc:
            print(f"{target}: error: {exc}")
            failed = True
            continue
        problems = [e for d in docs for e in validate_manifest(d)]
        if find_kustomization(target) is not None:
            problems += check_consistency(docs, DOCKERFILE)
        for problem in problems:
            print(f"{target}: {problem}")
        failed |= bool(problems)
        if not problems:
            print(f"{target}: OK ({len(docs)} objects)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
