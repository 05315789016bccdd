"""Shape rules of the source that no linter checks: wide positional signatures and attribute lookups by name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "speculative", "modeling", "proto", "deploy")
MAX_POSITIONAL = 7


def _sources() -> list[Path]:
    return [
        p
        for top in PACKAGES
        for p in (ROOT / top).rglob("*.py")
        if "_pb2" not in p.name and "__pycache__" not in p.parts
    ]


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


def wide_signatures(sources: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line name` of every function (Triton kernels aside) taking more than MAX_POSITIONAL positional
    parameters, not counting self or cls."""
    found = []
    for path in sources:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or _is_triton_kernel(fn):
                continue
            names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
            count = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
            if count > MAX_POSITIONAL:
                found.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name} ({count})")
    return found


def test_no_function_takes_more_than_seven_positional_parameters() -> None:
    sources = _sources()
    assert len(sources) > 100
    assert wide_signatures(sources) == []


def test_the_check_sees_a_wide_signature(tmp_path: Path) -> None:
    src = tmp_path / "wide.py"
    src.write_text(
        "import triton\n"
        "def wide(a, b, c, d, e, f, g, h): ...\n"
        "def fine(self, a, b, c, d, e, f, g, *, h): ...\n"
        "@triton.jit\n"
        "def kernel(a, b, c, d, e, f, g, h): ...\n"
    )
    assert wide_signatures([src], tmp_path) == ["wide.py:2 wide (8)"]


MAX_GETATTR = 25  # attributes looked up by name: reflection over protobufs, argparse, modules' fields


def test_attributes_are_rarely_looked_up_by_name() -> None:
    calls = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in _sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
    ]
    assert 0 < len(calls) <= MAX_GETATTR, calls
