"""Render a kustomization directory in pure Python, so the manifests can be checked offline.

This covers only what deploy/k8s uses, with kustomize's semantics for it:

- ``resources``: YAML files and other kustomization directories, in order.
- ``patches`` with a ``path``:
  - a mapping is a strategic-merge patch aimed at the object of the same kind and name.
    Mappings merge key by key, ``null`` deletes a key, ``$patch: delete`` at the top
    deletes the object, and lists are replaced as a whole. That last rule is what
    kustomize does for custom resources, whose merge keys it does not know. Merge keys
    of built-in kinds (containers by name, ...) are not implemented: a patch that puts
    a list into a built-in kind is refused rather than rendered differently.
  - a list is a JSON 6902 patch (``add``, ``replace``, ``remove``), aimed by ``target``.
- ``configMapGenerator`` with ``files`` and ``behavior`` create, replace or merge, and
  ``generatorOptions`` with ``labels``. Name hashing is not implemented, so
  ``disableNameSuffixHash: true`` is required.

Anything else in a kustomization.yaml raises RenderError.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "configMapGenerator", "generatorOptions"}


class RenderError(Exception):
    """A kustomization uses something this renderer does not support, or is inconsistent."""


def load_docs(path: str | Path) -> list[Any]:
    """All non-empty YAML documents of a file."""
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def find_kustomization(directory: str | Path) -> Path | None:
    """The kustomization file of a directory, or None."""
    for name in KUSTOMIZATION_FILES:
        candidate = Path(directory) / name
        if candidate.is_file():
            return candidate
    return None


def object_id(doc: Doc) -> tuple[str, str]:
    """(kind, name): how patches and generators find an object."""
    return str(doc.get("kind")), str((doc.get("metadata") or {}).get("name"))


def render(directory: str | Path) -> list[Doc]:
    """Render a kustomization directory into its list of objects."""
    directory = Path(directory)
    kfile = find_kustomization(directory)
    if kfile is None:
        raise RenderError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8")) or {}
    unknown = sorted(set(spec) - SUPPORTED_KEYS)
    if unknown:
        raise RenderError(f"{kfile}: unsupported fields {unknown}")

    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        for doc in _load_resource(directory / entry):
            _add(docs, doc, kfile)
    _generate_config_maps(docs, spec, directory, kfile)
    for patch in spec.get("patches", []):
        docs = _apply_patch(docs, patch, directory, kfile)
    return docs


def _load_resource(path: Path) -> list[Doc]:
    if path.is_dir():
        return render(path)
    docs = load_docs(path)
    for doc in docs:
        if not isinstance(doc, dict):
            raise RenderError(f"{path}: a resource document must be a mapping")
    return docs


def _add(docs: list[Doc], doc: Doc, origin: Path) -> None:
    if any(object_id(d) == object_id(doc) for d in docs):
        raise RenderError(f"{origin}: {object_id(doc)} is defined twice")
    docs.append(doc)


def _generate_config_maps(docs: list[Doc], spec: Doc, directory: Path, kfile: Path) -> None:
    generators = spec.get("configMapGenerator", [])
    if not generators:
        return
    options = spec.get("generatorOptions") or {}
    if options.get("disableNameSuffixHash") is not True:
        raise RenderError(f"{kfile}: name hashing is not implemented; set disableNameSuffixHash: true")
    for gen in generators:
        unknown = sorted(set(gen) - {"name", "files", "behavior"})
        if unknown:
            raise RenderError(f"{kfile}: configMapGenerator fields {unknown} are not supported")
        data = {}
        for item in gen.get("files", []):
            key, _, rel = item.partition("=") if "=" in item else (Path(item).name, "", item)
            data[key] = (directory / rel).read_text(encoding="utf-8")
        _place_config_map(docs, gen["name"], data, options.get("labels") or {}, behavior=gen.get("behavior", "create"))


def _place_config_map(docs: list[Doc], name: str, data: dict[str, str], labels: dict[str, str], behavior: str) -> None:
    existing = next((d for d in docs if object_id(d) == ("ConfigMap", name)), None)
    if behavior == "create":
        if existing is not None:
            raise RenderError(f"ConfigMap {name} already exists; use behavior replace or merge")
        meta: Doc = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
        return
    if behavior not in ("replace", "merge"):
        raise RenderError(f"ConfigMap {name}: unknown behavior {behavior!r}")
    if existing is None:
        raise RenderError(f"ConfigMap {name}: behavior {behavior} needs a ConfigMap from a base")
    existing["data"] = data if behavior == "replace" else {**existing.get("data", {}), **data}
    if labels:
        existing.setdefault("metadata", {}).setdefault("labels", {}).update(labels)


def _apply_patch(docs: list[Doc], entry: Doc, directory: Path, kfile: Path) -> list[Doc]:
    if set(entry) - {"path", "target"} or "path" not in entry:
        raise RenderError(f"{kfile}: only patches with 'path' (and optional 'target') are supported")
    patch_docs = load_docs(directory / entry["path"])
    if len(patch_docs) != 1:
        raise RenderError(f"{entry['path']}: expected exactly one patch document")
    patch = patch_docs[0]
    if isinstance(patch, list):
        target = entry.get("target") or {}
        if not target.get("kind") or not target.get("name"):
            raise RenderError(f"{entry['path']}: a JSON 6902 patch needs target.kind and target.name")
        doc = _find(docs, (target["kind"], target["name"]), entry["path"])
        docs[docs.index(doc)] = apply_json6902(doc, patch)
        return docs
    if not isinstance(patch, dict):
        raise RenderError(f"{entry['path']}: a patch is a mapping or a list of operations")
    doc = _find(docs, object_id(patch), entry["path"])
    if patch.get("$patch") == "delete":
        return [d for d in docs if d is not doc]
    if "." not in str(doc.get("apiVersion", "")).split("/")[0] and _has_list(patch):
        raise RenderError(f"{entry['path']}: list merge keys of built-in kinds are not implemented")
    docs[docs.index(doc)] = strategic_merge(doc, patch)
    return docs


def _find(docs: list[Doc], oid: tuple[str, str], origin: str) -> Doc:
    for doc in docs:
        if object_id(doc) == oid:
            return doc
    raise RenderError(f"{origin}: no object {oid[0]}/{oid[1]} to patch")


def _has_list(value: Any) -> bool:
    if isinstance(value, list):
        return True
    return isinstance(value, dict) and any(_has_list(v) for v in value.values())


def strategic_merge(base: Any, patch: Any) -> Any:
    """Merge patch into a copy of base: mappings recursively, None deletes, anything else replaces."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = strategic_merge(merged.get(key), value)
    return merged


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise RenderError(f"JSON patch path {path} does not exist") from exc
    return node


def apply_json6902(doc: Doc, ops: list[Doc]) -> Doc:
    """Apply JSON 6902 add/replace/remove operations to a copy of doc."""
    result = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        parts = _pointer(path)
        parent, last = _walk(result, parts[:-1], path), parts[-1]
        if kind == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind in ("replace", "remove"):
            _walk(parent, [last], path)  # must exist
            key: Any = int(last) if isinstance(parent, list) else last
            if kind == "replace":
                parent[key] = copy.deepcopy(op["value"])
            else:
                del parent[key]
        else:
            raise RenderError(f"JSON patch op {kind!r} is not supported")
    return result


def dump(docs: list[Doc]) -> str:
    """Multi-document YAML of the rendered objects."""
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m mtpserve.deploy.render DIR`` prints the rendered manifests."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mtpserve.deploy.render KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(dump(render(args[0])))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
