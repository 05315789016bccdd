"""What `serve` pays to start: a FrontEndPool (one engine process and `--frontends` front-end processes, as
`mtpserve serve` runs them) over the default model on the CPU, started and stopped `--repeats` times; the seconds
until it serves and the CPU seconds its processes spent, printed and saved. `--tree` imports mtpserve from another
checkout, to compare two commits on one machine.

python3 bench/probes/startup_cost.py --frontends 2 --repeats 3 --out $OUT [--tree OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process and of its finished children so far."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def start_once(frontends: int) -> dict[str, float]:
    """One pool started and stopped: seconds until it serves, and CPU seconds spent by its processes."""
    from mtpserve.cluster.service.front_end_pool import FrontEndPool
    from mtpserve.workers.config import MTPServeConfig

    cfg = MTPServeConfig.from_dict(
        {
            "model": {"device": "cpu"},
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "frontends": frontends},
        }
    )
    own0, kids0 = cpu_seconds()
    t0 = time.monotonic()
    pool = FrontEndPool(cfg, frontends)
    up = time.monotonic() - t0
    pool.stop(timeout=10.0)
    own1, kids1 = cpu_seconds()
    return {"ready_s": up, "children_cpu_s": kids1 - kids0, "parent_cpu_s": own1 - own0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frontends", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree", help="a checkout whose mtpserve to import (default: this one)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    tree = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(tree))
    from mtpserve.modeling.loader import resolve_model

    resolve_model(None)  # the default model converted once, before anything is timed
    runs = [start_once(args.frontends) for _ in range(args.repeats)]
    for r in runs:
        cpu = f"children {r['children_cpu_s']:.1f} s, this process {r['parent_cpu_s']:.1f} s"
        print(f"ready in {r['ready_s']:.1f} s; CPU: {cpu}")
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "tree": str(tree),
        "frontends": args.frontends,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup_cost.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
