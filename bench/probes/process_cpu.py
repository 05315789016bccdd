"""Where a command's CPU time goes, by kind of process: runs the command while sampling /proc every `--interval`
seconds, then sums the CPU seconds (user + system, as last seen) of the command's process tree by kind (pytest
workers, Ray workers, spawned engine and front-end processes, `mtpserve` subcommands, buildah, ...). Processes that
live less than one interval, or that leave the tree (daemons), are missed. Prints the table and saves every
process's line to `--out`.

python3 bench/probes/process_cpu.py --out OUT.json -- make test
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.bench.procs import cpu_s, read_stat

KINDS = (  # (kind, pattern over "comm | cmdline"), first match wins
    ("pytest xdist worker", r"exec\(eval\(sys\.stdin\.readline\(\)\)\)"),
    ("pytest", r"-m pytest|/pytest "),
    ("Ray worker", r"default_worker\.py|^ray::"),
    ("Ray daemons", r"raylet|gcs_server|ray/dashboard|ray/_private|ray/autoscaler"),
    ("spawned child (engine, front end)", r"spawn_main"),
    ("buildah, pip in the image", r"buildah|mmdebstrap|pip"),
    ("mtpserve command", r"-m mtpserve|bin/mtpserve"),
)


def sample(tree: dict[tuple[int, int], dict[str, Any]], pids: set[int]) -> None:
    """Record the CPU seconds now of every process in the tree of `pids` (new children join it), keyed by (pid,
    start time)."""
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        stat = read_stat(pid)
        if stat is None:
            continue
        comm, fields = stat
        try:
            key, cpu = (pid, int(fields[19])), cpu_s(fields)
            if key not in tree:
                if pid not in pids and int(fields[1]) not in pids:
                    continue
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                tree[key] = {"pid": pid, "comm": comm, "cmd": cmd[:300], "cpu_s": cpu}
                pids.add(pid)
            tree[key]["cpu_s"] = cpu
        except (OSError, IndexError, ValueError):
            continue  # the process ended between listing and reading


def kind_of(proc: dict[str, Any]) -> str:
    """The kind of a sampled process, from its name and command line."""
    text = f"{proc['comm']} | {proc['cmd']}"
    return next((kind for kind, pattern in KINDS if re.search(pattern, text)), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--out", default="process_cpu.json")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    pids = {proc.pid}
    while proc.poll() is None:
        sample(seen, pids)
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for rec in seen.values():
        rec["kind"] = kind_of(rec)
        by_kind[rec["kind"]].append(rec["cpu_s"])
    total = sum(sum(v) for v in by_kind.values())
    print(f"{' '.join(command)}: exit {proc.returncode}, {wall:.0f} s, {total:.0f} CPU s sampled")
    for kind, cpus in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(cpus):8.0f} CPU s  {len(cpus):5d} processes  {kind}")
    report = {"command": " ".join(command), "exit": proc.returncode, "wall_s": wall, "cpu_s": total}
    report["processes"] = sorted(seen.values(), key=lambda r: -r["cpu_s"])
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
