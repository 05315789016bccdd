"""Every benchmark command the documents show still parses: each `mtpserve bench ...`, `python3 bench/gpu.py
...` and `python3 bench/probes/X.py ...` line of a fenced shell block in a Markdown file, each inline code
span that is such a command with flags, and the Makefile's recipes go through the program's own argparse
parser, without running anything. Shell variables become a temporary path. A flag a command no longer takes
fails the test with the file and line that show it, so every README figure can be re-run from its command."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from mtpserve.cluster.cli.mtpserve import build_parser

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__"}
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
INLINE = re.compile(r"`((?:python3?|mtpserve) [^`]* --[^`]*)`")  # an inline command with at least one flag
VARIABLE = re.compile(r"\$\{[^}]*\}|\$\([^)]*\)|\$\w+")
PLACEHOLDER = "/tmp/doc-command"


@dataclass(frozen=True)
class Command:
    """One command a document shows: where, the program it runs and its arguments."""

    where: str  # path:line
    program: str  # "mtpserve", "bench/gpu.py" or "bench/probes/X.py"
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join([self.program, *self.argv])}"


def shell_lines(text: str, markdown: bool) -> list[tuple[int, str]]:
    """(first line number, logical line) of every shell line: in a Markdown file those inside fenced blocks of
    a shell language (or none) and inline commands, elsewhere every line; backslash continuations joined."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    pending, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if markdown and stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            pending = ""
            continue
        if markdown and fence is None:
            out += [(no, span) for span in INLINE.findall(raw)]
            continue
        if markdown and fence not in SHELL_FENCES:
            continue
        if not pending:
            start = no
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (comments dropped, variables replaced by a path), split at `&&`,
    `;`, pipes; leading `VAR=value` assignments removed."""
    lexer = shlex.shlex(VARIABLE.sub(PLACEHOLDER, line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a command line
        return []
    commands, current = [], []
    for tok in tokens:
        if tok in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(tok)
    commands.append(current)
    for cmd in commands:
        while cmd and re.fullmatch(r"\w+=.*", cmd[0]):
            cmd.pop(0)
    return [c for c in commands if c]


def benchmark_command(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(program, arguments) when the tokens run a benchmark, else None."""
    prog, rest = Path(tokens[0]).name, tokens[1:]
    if re.fullmatch(r"python3?(\.\d+)?", prog):
        if rest[:2] == ["-m", "mtpserve"]:
            prog, rest = "mtpserve", rest[2:]
        elif rest and re.fullmatch(r"bench/(gpu|probes/\w+)\.py", rest[0]):
            return rest[0], rest[1:]
        else:
            return None
    if prog == "mtpserve" and rest[:1] == ["bench"]:
        return "mtpserve", rest
    return None


def commands_in(path: Path, text: str) -> list[Command]:
    """Every benchmark command of one file."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for no, line in shell_lines(text, markdown=path.suffix == ".md"):
        for tokens in split_commands(line):
            hit = benchmark_command(tokens)
            if hit:
                found.append(Command(f"{rel}:{no}", hit[0], tuple(hit[1])))
    return found


def documents() -> list[Path]:
    """The Makefile and every Markdown file of the tree but the benchmark results."""
    paths = [ROOT / "Makefile"]
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        if here.relative_to(ROOT).parts[:2] == ("bench", "results"):
            dirs[:] = []
            continue
        paths += [here / n for n in sorted(files) if n.endswith(".md")]
    return paths


def parser_of(program: str) -> Callable[[list[str]], argparse.Namespace]:
    """The argument parsing of a program, as the program itself does it."""
    if program == "mtpserve":
        return build_parser().parse_args
    module = importlib.import_module(program.removesuffix(".py").replace("/", "."))
    if program == "bench/gpu.py":
        return module.parse_args
    return module.build_parser().parse_args


@contextlib.contextmanager
def exact_flags() -> Iterator[None]:
    """Parsers built meanwhile take flags only as spelled (`--repeat` no longer stands for `--repeats`), so a
    renamed flag is caught even where the old name is a prefix of the new one."""
    init = argparse.ArgumentParser.__init__

    def no_abbreviations(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "allow_abbrev": False})

    with mock.patch.object(argparse.ArgumentParser, "__init__", no_abbreviations):
        yield


def parse_error(command: Command) -> str | None:
    """None when the command's arguments parse, else what its parser said."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), exact_flags():
            parser_of(command.program)(list(command.argv))
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit status {exc.code}"
    return None


ALL = [c for path in documents() for c in commands_in(path, path.read_text(errors="replace"))]


@pytest.mark.parametrize("command", ALL, ids=[c.where for c in ALL])
def test_documented_command_parses(command: Command) -> None:
    error = parse_error(command)
    assert error is None, f"{command}\n  -> {error}"


def test_the_documents_show_every_kind_of_benchmark_command() -> None:
    programs = {c.program for c in ALL}
    assert {"mtpserve", "bench/gpu.py"} <= programs
    assert any(p.startswith("bench/probes/") for p in programs)
    kinds = {c.argv[1] for c in ALL if c.program == "mtpserve"}
    want = {"throughput", "acceptance", "prefix-cache", "ttft", "trees", "load", "distributed", "http-vs-grpc", "serve"}
    assert want <= kinds, f"bench/README.md shows no command for {sorted(want - kinds)}"
    assert any(c.where.startswith("Makefile:") for c in ALL)


def test_a_stale_flag_is_found_and_named(tmp_path: Path) -> None:
    doc = tmp_path / "NOTES.md"
    doc.write_text(
        "Inline `mtpserve bench ttft --gone` and `python3 bench/gpu.py --groups decode`; `mtpserve bench ttft`.\n"
        "```bash\n"
        "mtpserve bench ttft --lengths 16 --json $OUT/t.json     # fine\n"
        "cd x && python3 bench/gpu.py --groups decode \\\n"
        "    --no-such-flag 3 --out ${OUT}\n"
        "SEED=1 python3 -m mtpserve bench trees --configs 'chain K=9'\n"
        "python3 bench/probes/kernel_check.py --out $OUT | tee log\n"
        "mtpserve generate --prompt 'hi'\n"
        "mtpserve bench ttft --length 16\n"
        "```\n"
        "```python\n"
        "mtpserve bench load --bogus\n"
        "```\n"
    )
    found = commands_in(doc, doc.read_text())
    assert [(c.where.rsplit(":", 1)[1], c.program) for c in found] == [
        ("1", "mtpserve"),
        ("1", "bench/gpu.py"),
        ("3", "mtpserve"),
        ("4", "bench/gpu.py"),
        ("6", "mtpserve"),
        ("7", "bench/probes/kernel_check.py"),
        ("9", "mtpserve"),
    ]
    assert found[2].argv[-1] == f"{PLACEHOLDER}/t.json" and found[3].argv[-1] == PLACEHOLDER
    errors = [parse_error(c) for c in found]
    assert errors[0] is not None and "unrecognized arguments: --gone" in errors[0]
    assert errors[1] is None and errors[2] is None and errors[5] is None
    assert errors[3] is not None and "unrecognized arguments: --no-such-flag 3" in errors[3]
    assert errors[4] is not None and "unknown configuration(s) ['chain K=9']" in errors[4]
    assert errors[6] is not None and "unrecognized arguments: --length 16" in errors[6]  # not taken for --lengths
