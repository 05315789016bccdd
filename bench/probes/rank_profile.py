"""Where the Ray path's host time goes at batch 64: an engine over one target worker actor (TP=1, draft colocated,
two steps launched ahead) decodes while py-spy samples the worker (the rank) and this process (the scheduler side),
each into collapsed stacks; a summary of the functions holding most samples per process is printed and saved.

python3 bench/probes/rank_profile.py --model $M --batch 64 --ks 0,3 --seconds 8 --py-spy PATH --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.distributed.build import build_engine
from mtpserve.workers.config import MTPServeConfig


def worker_pids() -> list[int]:
    """Processes running a TargetWorker actor."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "TargetWorker" in line and "ps -eo" not in line]


def top_frames(path: Path, n: int = 25) -> dict[str, list[tuple[str, float]]]:
    """Per collapsed-stack file: the functions with the most samples anywhere on the stack (inclusive share), and
    the leaf functions with the most samples (self share)."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        for f in set(frames):
            inclusive[f] += k
        leaf[frames[-1]] += k

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(v / max(total, 1), 4)) for f, v in c.most_common(n)]

    return {"samples": [("total", float(total))], "inclusive": share(inclusive), "self": share(leaf)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ks", default="0,3")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=6000, help="per request: enough to decode through the window")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"command": " ".join(sys.argv), "batch": args.batch}
    for k in [int(x) for x in args.ks.split(",")]:
        cfg = MTPServeConfig.from_dict(
            {
                "model": {"path": args.model, "device": args.device},
                "speculative": {"enabled": k > 0, "num_draft_tokens": max(k, 1), "adaptive": False},
                "parallel": {"distributed": True, "draft_placement": "colocated"},
                "scheduler": {"max_num_requests": args.batch},
            }
        )
        engine = build_engine(cfg)
        prompt = [(7 * i + 3) % 90 for i in range(64)]  # ids any vocabulary holds
        for _ in range(args.batch):
            engine.add_request(prompt, {"max_tokens": args.max_tokens, "ignore_eos": True})
        for _ in range(50):
            engine.step()
        ranks = worker_pids()
        files = {"rank": out / f"rank_k{k}.txt", "scheduler": out / f"scheduler_k{k}.txt"}
        spies = [
            subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(args.seconds)),
                    "-r",
                    "400",
                    "-f",
                    "raw",
                    "--nonblocking",
                    "--function",
                    "-o",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pid, path in ((ranks[0], files["rank"]), (os.getpid(), files["scheduler"]))
        ]
        steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.seconds + 1.0:
            engine.step()
            steps += 1
        dt = (time.perf_counter() - t0) / steps
        errors = [s.communicate()[1][-400:] for s in spies]
        row: dict[str, object] = {"k": k, "step_ms": round(1000 * dt, 3), "steps": steps, "py_spy_errors": errors}
        for name, path in files.items():
            row[name] = top_frames(path) if path.is_file() else None
        report[f"k{k}"] = row
        print(json.dumps({"k": k, "step_ms": row["step_ms"], "errors": errors}))
        for name in files:
            prof = row[name]
            if isinstance(prof, dict):
                print(f"-- {name} (K={k}) inclusive")
                for f, v in prof["inclusive"][:25]:
                    print(f"{v:7.3f}  {f}")
                print(f"-- {name} (K={k}) self")
                for f, v in prof["self"][:15]:
                    print(f"{v:7.3f}  {f}")
        engine.shutdown()
    (out / "rank_profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
