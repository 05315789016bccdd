"""Where `mtpserve serve`'s host time goes while it serves: `mtpserve bench serve` (one config, one stream count, one
front-end API) runs, and over its measured window py-spy samples every process of the server's tree (with
--serve-args=--distributed: Ray's actors too) by thread; the samples are split by process (the engine process, each
front end, the scheduler actor, the target worker, ...) and the functions holding most of each are printed and saved.

python3 bench/probes/serve_profile.py --model $M --config target-only --streams 64 --api http --frontends 4 \
    --py-spy PATH --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from rank_profile import top_frames

ROLES = (  # a process's role from its command line, first match wins
    ("bench", "bench serve"),
    ("serve", "mtpserve serve"),
    ("child", "multiprocessing"),
)
WARMUP_S = 3.0  # the --warmup-s given to bench: its window starts this long after its `measuring:` line
ACTORS = (  # a Ray worker process's role from the code its stacks run (its command line is Ray's)
    ("scheduler-actor", "scheduler_actor.py"),
    ("target-worker", "target_worker.py"),
    ("draft-worker", "draft_worker.py"),
)


def split_by_process(raw: Path, out: Path) -> dict[str, Path]:
    """py-spy `--subprocesses` raw stacks into one collapsed-stack file per process (the innermost `process` frame
    of each stack names it); returns the files by a process label."""
    by_pid: dict[str, list[str]] = collections.defaultdict(list)
    names: dict[str, str] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        marks = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not marks or not count.isdigit():
            continue
        head = frames[marks[-1]]
        pid = re.match(r"process (\d+)", head)
        key = pid.group(1) if pid else head
        names[key] = head
        body = frames[marks[-1] + 1 :]
        if body:
            by_pid[key].append(f"{';'.join(body)} {count}")
    files: dict[str, Path] = {}
    for pid, lines in by_pid.items():
        role = next((r for r, needle in ROLES if needle in names[pid]), "other")
        if role == "other":
            text = "\n".join(lines)
            role = next((r for r, needle in ACTORS if needle in text), role)
        path = out / f"serve_prof_{role}_{pid}.txt"
        path.write_text("\n".join(lines) + "\n")
        files[f"{role} {pid}"] = path
    return files


def profile_window(bench: list[str], args: argparse.Namespace, raw: Path) -> str:
    """Run `bench`; once it starts measuring (its `measuring:` line, after the warm-up), sample the server's
    process tree for the window; returns bench's stderr."""
    proc = subprocess.Popen(bench, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    spies: list[threading.Thread] = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"^measuring: .* serve pid (\d+)", line)
        if found and not raw.exists():
            time.sleep(WARMUP_S)
            spy = [args.py_spy, "record", "-s", "--threads", "-r", str(args.rate), "-f", "raw", "--nonblocking"]
            spy += ["-d", str(max(1, int(args.window_s) - 1)), "-o", str(raw), "-p", found.group(1)]
            spies.append(threading.Thread(target=subprocess.run, args=(spy,), kwargs={"capture_output": True}))
            spies[-1].start()
    proc.wait()
    for spy_thread in spies:  # py-spy has written the whole window before it is read
        spy_thread.join()
    return "".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file or HF directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead (dry runs)")
    p.add_argument("--config", default="target-only", choices=["target-only", "speculative"])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--api", default="http", choices=["http", "grpc"])
    p.add_argument("--frontends", type=int, default=4)
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--rate", type=int, default=100, help="samples per second and process")
    p.add_argument("--serve-args", default="", help="more `mtpserve serve` flags, space-separated (--distributed)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "serve_prof_raw.txt"
    bench = [sys.executable, "-m", "mtpserve", "bench", "serve", "--device", args.device, "--no-engine-alone"]
    bench += ["--tiny"] if args.tiny else ["--model", args.model]
    bench += ["--configs", args.config, "--streams", str(args.streams), "--front-ends", args.api]
    bench += ["--frontends", str(args.frontends), "--client-procs", str(args.client_procs), "--warmup-s", str(WARMUP_S)]
    bench += ["--window-s", str(args.window_s), "--json", str(out / "serve_prof_bench.json")]
    bench += [f"--serve-args={args.serve_args}"] if args.serve_args else []
    log = profile_window(bench, args, raw)
    print(log[-3000:])
    report: dict[str, object] = {"command": " ".join(sys.argv), "bench": " ".join(bench), "processes": {}}
    if raw.is_file():
        for label, path in split_by_process(raw, out).items():
            prof = top_frames(path)
            report["processes"][label] = prof  # type: ignore[index]
            print(f"-- {label}: {int(prof['samples'][0][1])} samples; inclusive")
            for f, v in prof["inclusive"][:20]:
                print(f"{v:7.3f}  {f}")
            print(f"-- {label} self")
            for f, v in prof["self"][:12]:
                print(f"{v:7.3f}  {f}")
    (out / "serve_profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
