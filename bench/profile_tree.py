"""Where does a captured draft-tree step's time go? Host fill, graph replay and read-back, and the kernels of
the same step run eagerly.

python bench/profile_tree.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
Writes profile_tree.json and profile_tree_kernels.txt under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine import LLMEngine
from speculative.sampling import SamplingMode
from workers.builders import DEFAULT_HEAD
from workers.config import MTPServeConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model path (default: SmolLM2)")
    ap.add_argument("--out", default="out")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": args.model, "device": "cuda", "dtype": "bfloat16", "max_model_len": 2048},
            "scheduler": {"max_num_requests": 8, "prefix_caching": False},
            "speculative": {
                "draft": str(DEFAULT_HEAD),
                "num_draft_tokens": args.depth,
                "tree_budget": args.budget,
                "tree_width": args.width,
            },
        }
    )
    eng = LLMEngine.from_config(cfg)
    step = eng.target.tree_step  # type: ignore[attr-defined]
    prompt = eng.encode_prompt("Explain how a hash map works and when it is a poor choice.")
    rid = eng.add_request(prompt, {"max_tokens": 4000, "ignore_eos": True})
    req = eng.scheduler.requests[rid]
    while req.in_context:
        eng.step()
    for _ in range(5):
        eng.step()
    times = {"schedule": 0.0, "fill": 0.0, "replay_gpu": 0.0, "replay_wall": 0.0, "update": 0.0, "total": 0.0}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    original = step.steps.run

    def timed_run(bucket: int, mode: SamplingMode) -> torch.Tensor:
        torch.cuda.synchronize()
        times["fill"] += time.perf_counter() - fill_started[0]
        t0 = time.perf_counter()
        start.record()
        out = original(bucket, mode)
        end.record()
        torch.cuda.synchronize()
        times["replay_wall"] += time.perf_counter() - t0
        times["replay_gpu"] += start.elapsed_time(end) / 1e3
        return out

    fill_started = [0.0]
    step.steps.run = timed_run
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = eng.scheduler.schedule()
        t1 = time.perf_counter()
        fill_started[0] = t1
        out = eng.target.execute(plan)
        t2 = time.perf_counter()
        eng.scheduler.update(plan, out, out.draft_outputs)
        t3 = time.perf_counter()
        times["schedule"] += t1 - t0
        times["update"] += t3 - t2
        times["total"] += t3 - t0
    step.steps.run = original
    report = {k: 1e3 * v / args.steps for k, v in times.items()}
    report["acceptance_length"] = req.stats.acceptance_length
    bucket = 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step._forward(bucket, SamplingMode.GREEDY)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile_tree_kernels.txt").write_text(table)
    report["eager_forward_kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA") / 5
    (out_dir / "profile_tree.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
