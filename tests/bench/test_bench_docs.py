"""`bench/` stays readable: every file in `bench/results` is named by a document, there are at most 40 of
them, and `bench/README.md` holds at most 300 lines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MAX_RESULTS = 40
MAX_README_LINES = 300
SKIP_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__"}


def documents(root: Path) -> dict[Path, str]:
    """Every Markdown file of the tree outside `bench/results` (a result file naming another does not count)."""
    docs = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        if here.relative_to(root).parts[:2] == ("bench", "results"):
            dirs[:] = []
            continue
        for name in files:
            if name.endswith(".md"):
                docs[(here / name).relative_to(root)] = (here / name).read_text(errors="replace")
    return docs


def unnamed_results(root: Path) -> list[str]:
    """Files under `bench/results` whose name no document mentions."""
    text = "\n".join(documents(root).values())
    results = root / "bench" / "results"
    return sorted(str(p.relative_to(results)) for p in results.rglob("*") if p.is_file() and p.name not in text)


def test_every_result_file_is_named_by_a_document() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert files, "bench/results is empty"
    assert unnamed_results(ROOT) == []


def test_results_stay_few() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= MAX_RESULTS, f"{len(files)} files in bench/results; keep the current ones, git has the rest"


def test_bench_readme_stays_short() -> None:
    lines = (ROOT / "bench" / "README.md").read_text().splitlines()
    assert 0 < len(lines) <= MAX_README_LINES, f"bench/README.md has {len(lines)} lines (limit {MAX_README_LINES})"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the documents and result files."""
    for rel, text in documents(ROOT).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for path in RESULTS.rglob("*"):
        if path.is_file():
            dest = tmp_path / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(path.read_bytes())
    return tmp_path


def test_an_unnamed_result_file_is_found(tree: Path) -> None:
    assert unnamed_results(tree) == []
    (tree / "bench" / "results" / "h200" / "probe_of_the_day.json").write_text("{}\n")
    assert unnamed_results(tree) == ["h200/probe_of_the_day.json"]
    # a result file naming it does not count as a document
    (tree / "bench" / "results" / "notes.md").write_text("see probe_of_the_day.json\n")
    assert "h200/probe_of_the_day.json" in unnamed_results(tree)
    # a document naming it does
    readme = tree / "bench" / "README.md"
    readme.write_text(readme.read_text() + "\nSee `probe_of_the_day.json` and `notes.md`.\n")
    assert unnamed_results(tree) == []
