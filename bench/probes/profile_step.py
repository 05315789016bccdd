"""Where does a decode step's time go? Phase timings and a torch.profiler table, any device.

python3 bench/probes/profile_step.py --device cuda --out $OUT        # SmolLM2-135M shape, random weights
python3 bench/probes/profile_step.py --device cuda --shape DIR --variants target-graph,tree4x16-graph --out $OUT
    (DIR holds a config.json, e.g. Llama-3-8B's: that shape with random weights)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling import fused_kernels
from mtpserve.modeling.layer_ops import TritonOps
from mtpserve.workers.config import MTPServeConfig

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip


def sync() -> None:
    """Wait for the GPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Mean ms per step in schedule / execute / update (one step at a time, no overlap), then the mean
    wall ms of engine.step() as served (with overlap where the engine uses it)."""
    engine.drain()
    acc = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        t1 = time.perf_counter()
        out = engine.target.execute(plan)
        sync()
        t2 = time.perf_counter()
        engine.scheduler.update(plan, out, out.draft_outputs)
        t3 = time.perf_counter()
        acc["schedule"] += t1 - t0
        acc["execute"] += t2 - t1
        acc["update"] += t3 - t2
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    acc["engine_step"] = time.perf_counter() - t0
    return {k: 1e3 * v / steps for k, v in acc.items()}


class HostTimer:
    """Wall time spent inside chosen functions while the engine serves steps (host-side split of a step).
    Spans nest: `launch` includes `fill_step` and `graph_replay`; `collect` includes `wait_gpu`."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        """Time every call of owner.name under `label` until `restore`."""
        fn = getattr(owner, name)
        self._undo.append((owner, name, owner.__dict__.get(name, fn) if hasattr(owner, "__dict__") else fn))
        acc = self.acc
        acc.setdefault(label, 0.0)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Put every wrapped function back."""
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def host_split(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Mean host ms per served step inside scheduling, launching (buffer fill, graph replay), waiting for
    the GPU, reading results and applying them."""
    import mtpserve.workers.fused_step
    import mtpserve.workers.graph_runner
    import mtpserve.workers.uniform_step

    timer = HostTimer()
    runner = engine.target
    timer.wrap(engine.scheduler, "plan_ahead", "plan_ahead")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine, "_apply", "apply")
    timer.wrap(runner, "launch", "launch")
    timer.wrap(runner, "collect", "collect")
    timer.wrap(runner, "execute", "execute")
    timer.wrap(mtpserve.workers.fused_step, "fill_step", "fill_step")
    timer.wrap(mtpserve.workers.uniform_step, "fill_step", "fill_step")
    timer.wrap(mtpserve.workers.graph_runner.GreedyAndSampledSteps, "run", "graph_replay")
    if torch.cuda.is_available():
        timer.wrap(torch.cuda.Event, "synchronize", "wait_gpu")
    try:
        engine.drain()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        total = time.perf_counter() - t0
    finally:
        timer.restore()
    out = {f"host_{k}": 1e3 * v / steps for k, v in timer.acc.items()}
    out["host_engine_step"] = 1e3 * total / steps
    return out


SHORT_GAP_US = 20.0  # idle time between two kernels below this counts as launch gaps, above as host stalls


def device_summary(prof: torch.profiler.profile, steps: int) -> dict[str, float]:
    """GPU kernels, busy time and idle time per step, from the profiler's device-side events. Idle time is
    split into short gaps between back-to-back kernels (launch latency inside graphs) and longer stalls
    (the GPU waiting for the host)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels)
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    short = long = 0.0
    for (_, end), (start, _) in itertools.pairwise(spans):
        gap = max(0.0, start - end)
        if gap < SHORT_GAP_US:
            short += gap
        else:
            long += gap
    return {
        "gpu_kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "gpu_short_gaps_ms_per_step": short / 1e3 / steps,
        "gpu_host_stalls_ms_per_step": long / 1e3 / steps,
    }


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="out")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--shape", help="a directory with a config.json to profile instead of SmolLM2-135M's shape")
    ap.add_argument("--max-num-requests", type=int, default=8, help="batch slots (and CUDA-graph buckets) to build")
    ap.add_argument("--draft-vocab", type=int, default=0, help="the random head's draft vocabulary (0: the target's)")
    ap.add_argument(
        "--gemv-rows",
        type=int,
        default=0,
        help="matrix-vector kernels for steps of up to this many rows (0: as built)",
    )
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.prompt_len == 64 else f"_p{args.prompt_len}"
    if args.shape:
        suffix += "_" + Path(args.shape).name
    if args.draft_vocab:
        suffix += f"_v{args.draft_vocab}"
    tmp = Path(tempfile.mkdtemp())
    config = json.loads((Path(args.shape) / "config.json").read_text()) if args.shape else SMOLLM2
    (tmp / "config.json").write_text(json.dumps(config))
    report = {}
    variants = [  # name, K, CUDA graphs, Triton layer kernels, matrix-vector kernels, speculative overlap, tree
        ("target-eager", 0, False, True, True, False, None),
        ("target-graph", 0, True, True, True, False, None),
        ("target-graph-no-gemv", 0, True, True, False, False, None),
        ("target-graph-unfused", 0, True, False, False, False, None),
        ("mtp1-graph", 1, True, True, True, True, None),
        ("mtp1-graph-no-overlap", 1, True, True, True, False, None),
        ("mtp3-graph", 3, True, True, True, True, None),
        ("mtp3-graph-no-overlap", 3, True, True, True, False, None),
        ("mtp3-graph-no-gemv", 3, True, True, False, True, None),
        ("mtp3-graph-unfused", 3, True, False, False, True, None),
        ("tree3x8-graph", 3, True, True, True, True, (8, 3)),  # depth 3, 8 nodes, width 3
        ("tree4x16-graph", 4, True, True, True, True, (16, 4)),
        ("tree4x16-graph-no-gemv", 4, True, True, False, True, (16, 4)),
        ("tree4x16-eager", 4, False, True, True, True, (16, 4)),
    ]
    if args.variants:
        chosen = args.variants.split(",")
        unknown = set(chosen) - {v[0] for v in variants}
        if unknown:
            ap.error(f"--variants: unknown {sorted(unknown)}; choose from {[v[0] for v in variants]}")
        variants = [v for v in variants if v[0] in chosen]
    if args.gemv_rows:
        fused_kernels.GEMV_MAX_ROWS = TritonOps.small_rows = args.gemv_rows
        suffix += f"_g{args.gemv_rows}"
    small_rows = TritonOps.small_rows
    for name, k, graphs, fused, gemv, overlap_spec, tree in variants:
        budget, width = tree or (0, 4)
        TritonOps.small_rows = small_rows if gemv else 0
        cfg = MTPServeConfig.from_dict({
            "model": {"path": str(tmp), "load_format": "dummy", "device": args.device, "cuda_graphs": graphs,
                      "fused_kernels": fused, "max_model_len": max(2048, args.prompt_len + 1024),
                      "overlap_speculative": overlap_spec,
                      "dtype": "bfloat16" if args.device == "cuda" else "float32"},
            "scheduler": {"max_num_requests": max(args.max_num_requests, args.batch)},
            "speculative": {"enabled": k > 0, "draft": "random", "num_draft_tokens": max(k, 1),
                            "tree_budget": budget, "tree_width": width, "draft_vocab": args.draft_vocab,
                            "adaptive": False},
        })  # fmt: skip
        eng = LLMEngine.from_config(cfg)
        for i in range(args.batch):
            eng.add_request(list(range(100 + i, 100 + i + args.prompt_len)), {"max_tokens": 10_000, "ignore_eos": True})
        for _ in range(5):
            eng.step()
        sync()
        report[name] = phases(eng, args.steps)
        report[name].update(host_split(eng, args.steps))
        print(name, json.dumps(report[name]), flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(10):
                eng.step()
            sync()
        report[name].update(device_summary(prof, 10))
        print(name, json.dumps(report[name]), flush=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if args.device == "cuda":
            table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        (out / f"profile_{name}_b{args.batch}{suffix}.txt").write_text(table)
        print(table[:6000], flush=True)
        del eng
    (out / f"profile_phases_b{args.batch}{suffix}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
