"""Shape rules of the source that no linter checks: wide positional signatures, wide positional calls and attribute
lookups by name."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "speculative", "modeling", "proto", "deploy")
MAX_POSITIONAL = 7


def _sources(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return [
        p
        for top in packages
        for p in (ROOT / top).rglob("*.py")
        if "_pb2" not in p.name and "__pycache__" not in p.parts
    ]


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


Counted = tuple[ast.stmt | ast.expr, str, int]  # a node, its name and its count of positional parameters or arguments


def _over(sources: list[Path], root: Path, counts: Callable[[ast.Module], Iterator[Counted]], limit: int) -> list[str]:
    """`path:line name (count)` of every node that `counts` finds in the sources with a count over `limit`."""
    return [
        f"{path.relative_to(root)}:{node.lineno} {name} ({count})"
        for path in sources
        for node, name, count in counts(ast.parse(path.read_text()))
        if count > limit
    ]


def _positional_parameters(tree: ast.Module) -> Iterator[Counted]:
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(fn):
            names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
            yield fn, fn.name, len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def wide_signatures(sources: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line name` of every function (Triton kernels aside) taking more than MAX_POSITIONAL positional
    parameters, not counting self or cls."""
    return _over(sources, root, _positional_parameters, MAX_POSITIONAL)


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


MAX_POSITIONAL_ARGS = 4  # past this many arguments a call names them (issue #60)


def _positional_by_nature(func: ast.expr) -> bool:
    """Calls whose arguments go by position: Triton launches `kernel[grid](...)`, torch's functions and zip."""
    if isinstance(func, ast.Subscript):
        return True
    if isinstance(func, ast.Name):
        return func.id == "zip"
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id == "torch"


def _positional_arguments(tree: ast.Module) -> Iterator[Counted]:
    in_kernels = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and _is_triton_kernel(fn)
        for node in ast.walk(fn)
    }
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and id(call) not in in_kernels and not _positional_by_nature(call.func):
            yield call, ast.unparse(call.func), sum(not isinstance(a, ast.Starred) for a in call.args)


def wide_calls(sources: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line callee` of every call (outside Triton kernels) passing more than MAX_POSITIONAL_ARGS positional
    arguments, `*args` not counted."""
    return _over(sources, root, _positional_arguments, MAX_POSITIONAL_ARGS)


def test_no_call_passes_more_than_four_positional_arguments() -> None:
    sources = _sources((*PACKAGES, "bench"))
    assert any(p.parts[len(ROOT.parts)] == "bench" for p in sources)
    assert wide_calls(sources) == []


def test_the_check_sees_a_wide_call(tmp_path: Path) -> None:
    src = tmp_path / "calls.py"
    src.write_text(
        "import torch, triton\n"
        "f(1, 2, 3, 4, 5)\n"
        "f(1, 2, 3, 4, e=5)\n"
        "f(*xs, 1, 2, 3, 4)\n"
        "kernel[grid](1, 2, 3, 4, 5)\n"
        "torch.zeros(1, 2, 3, 4, 5)\n"
        "@triton.jit\n"
        "def kernel(a):\n"
        "    g(1, 2, 3, 4, 5)\n"
    )
    assert wide_calls([src], tmp_path) == ["calls.py:2 f (5)"]


MAX_GETATTR = 25  # attributes looked up by name: reflection over protobufs, argparse, modules' fields


def test_attributes_are_rarely_looked_up_by_name() -> None:
    calls = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in _sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
    ]
    assert 0 < len(calls) <= MAX_GETATTR, calls
