"""A served process tree as the benchmarks measure it: the `serve` process and its descendants (the engine
process among them). CPU seconds and resident memory from Linux /proc, GPU memory from nvidia-smi."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
        i += 1
    return pids


def read_stat(pid: int) -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of /proc/PID/stat; None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :].split()


def cpu_s(fields: list[str]) -> float:
    """User plus system CPU seconds in the fields `read_stat` returns."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int | None) -> float | None:
    """User plus system CPU seconds so far of a process and its live descendants; None without /proc."""
    if pid is None or not Path(f"/proc/{pid}/stat").is_file():
        return None
    stats = (read_stat(p) for p in process_tree(pid))
    return sum(cpu_s(fields) for _, fields in filter(None, stats))


def tree_rss_mb(pid: int) -> float:
    """Resident memory in MiB of a process and its live descendants."""
    total = 0.0
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:"))
    return total


def tree_gpu_mb(pid: int) -> float | None:
    """GPU memory held by a process and its live descendants (nvidia-smi); None without a GPU or when none of
    them holds any."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pids = {str(p) for p in process_tree(pid)}
    rows = [line.split(",") for line in out.splitlines()]
    held = [float(row[1]) for row in rows if len(row) == 2 and row[0].strip() in pids]
    return sum(held) if held else None
