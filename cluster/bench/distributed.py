"""`mtpserve bench distributed`: the Ray path against the in-process engine: decode step time per setup, draft
depth and batch size, with the per-hop timeline and bytes.

Every setup (--setups, names from SETUPS) runs target-only (K=0) and with K draft tokens over the same
prompt. Per depth all setups are built first and measured in turn, --repeats times, so a slow moment of the
host hits them alike; `results` keeps the best of each (setup, K, batch) row and its step rate against
in-process, `runs` every measurement. --shape smollm2 loads the real SmolLM2 (--model, default the packaged
one) and --draft (default the shipped head); `tiny` (hidden 128, 4 layers) and a directory holding a
config.json load random weights and a random head: timing only, since a random head accepts almost nothing,
so K>0 steps there cost drafting without its gain.

Setups: `in-process` (the engine in this process, one decode step launched ahead), `in-process-ahead2` (two),
`ray-tp1` (a scheduler-side engine and one target worker actor with the draft colocated, steps over the
Unix-socket link, two decode steps launched ahead), `ray-tp1-ahead1` (one), `ray-tp1-sync` (the same, every step
answered before the next is planned), `ray-tp1-grpc` (the gRPC stream instead of the socket), `ray-tp2`,
`ray-tp2-separate` (plus a draft worker actor). Per Ray step the timeline follows one step through both
processes (SEGMENTS: to the rank, launched on the device, results read, reply encoded, back to the scheduler, the
scheduler's turn until its next send), as medians; `hops_per_step` adds the scheduler's encode/decode and wait
and the bytes per hop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.builders import DEFAULT_HEAD
from mtpserve.workers.config import MTPServeConfig

PROMPT = "Write a few sentences about why the ocean is salty."
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
}  # fmt: skip
SETUPS: dict[str, dict[str, Any]] = {  # name: config overrides of the base config
    "in-process": {},
    "in-process-ahead2": {"model.steps_ahead": 2},
    "ray-tp1": {"parallel.distributed": True, "parallel.draft_placement": "colocated"},  # two steps ahead
    "ray-tp1-ahead1": {"parallel.distributed": True, "parallel.draft_placement": "colocated", "model.steps_ahead": 1},
    "ray-tp1-sync": {"parallel.distributed": True, "model.overlap_steps": False},
    "ray-tp1-grpc": {"parallel.distributed": True, "parallel.step_transport": "grpc"},
    "ray-tp2": {"parallel.tp_size": 2, "parallel.draft_placement": "colocated"},
    "ray-tp2-separate": {"parallel.tp_size": 2, "parallel.draft_placement": "separate"},
}
HOP_KEYS = ("wait_s", "worker_s", "transit_s", "encode_s", "decode_s", "plan_bytes", "output_bytes", "draft_hop_s")
SEGMENTS = {  # one answered step's path, in the order it happens (both hosts' perf_counter clocks agree)
    "to_rank": ("sent", "t_received"),  # scheduler encodes and sends, the rank's link thread wakes and reads
    "rank_queue": ("t_received", "t_queued"),  # the rank decodes, checks and queues (launch) or starts it
    "rank_device": ("t_queued", "t_done"),  # queued until its results are read (device time, and for a launched
    # step also the next message's wait and queueing)
    "rank_reply": ("t_done", "t_replied"),  # the rank encodes its answer
    "to_scheduler": ("t_replied", "got"),  # the answer crosses back and the scheduler decodes it
    "scheduler_turn": ("got", "next_send"),  # the scheduler applies the step, plans and encodes the next
}
SETTINGS = ("shape", "setups", "ks", "batches", "steps", "repeats", "enforce_eager", "dtype")


def add_parser(kinds: argparse._SubParsersAction, build_engine: bench_report.EngineFactory) -> None:
    """Register `bench distributed`; `build_engine` makes an engine of a config, Ray actors included."""
    p = bench_report.add_command(
        kinds, "distributed", "the Ray path against in-process: step time, per-hop timeline and bytes", __doc__
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--shape", default="tiny", help="smollm2 (real weights), tiny, or a directory with a config.json")
    p.add_argument("--model", help="with --shape smollm2: a GGUF or HF directory (default: the packaged one)")
    p.add_argument("--draft", "--head", dest="draft", default=str(DEFAULT_HEAD), help="with --shape smollm2: the head")
    p.add_argument("--setups", type=setup_list, default=["in-process", "ray-tp1"], help=f"comma list of {list(SETUPS)}")
    p.add_argument("--batches", type=bench_report.int_list, default=[1, 16], help="batch sizes (default 1,16)")
    p.add_argument("--ks", type=bench_report.depth_list, default=[0, 3], help="draft depths (0: target-only)")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per row")
    p.add_argument("--repeats", type=int, default=1, help="measure each row this many times (setups alternate)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of this process (default 1)")
    p.add_argument("--json", metavar="OUT", help="write the report (command, environment, settings, results)")
    p.add_argument("--plot", metavar="OUT.png", help="plot the best step time per setup")
    p.set_defaults(func=main, build_engine=build_engine)


def setup_list(text: str) -> list[str]:
    """argparse type: comma-separated setup names, each one of SETUPS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown setup(s) {unknown}; choose from {list(SETUPS)}")
    return names


def config(args: argparse.Namespace, k: int, shape_dir: Path | None) -> dict[str, Any]:
    """The base config of every setup for one draft depth (0 = target-only); `shape_dir` holds the
    config.json of a random-weight shape (None: --shape smollm2)."""
    base: dict[str, Any] = {
        "model": {"device": args.device, "dtype": args.dtype, "path": args.model, "max_model_len": 2048},
        "scheduler": {"max_num_requests": max(args.batches), "prefix_caching": False},
        "speculative": {"num_draft_tokens": max(k, 1), "enabled": k > 0, "draft": args.draft, "adaptive": False},
    }
    if shape_dir is not None:
        base["model"].update(path=str(shape_dir), load_format="dummy")
        base["speculative"]["draft"] = "random"
    if args.enforce_eager:
        base["model"]["cuda_graphs"] = False
    return base


@runtime_checkable
class HopCounting(Protocol):
    """A target over Ray ranks that counts its hops and stamps each answered step (`RemoteTarget`)."""

    hops: dict[str, float]
    timeline: Iterable[dict[str, float]]


def measure(engine: LLMEngine, batch: int, steps: int) -> dict[str, Any]:
    """Mean wall time of generation steps (after every prompt is prefilled), and the hop counters per step."""
    ids = engine.encode_prompt(PROMPT) if engine.tokenizer is not None else list(range(10, 40))
    rids = [engine.add_request(ids, {"max_tokens": 4 * steps + 16, "ignore_eos": True}) for _ in range(batch)]
    reqs = [engine.scheduler.requests[r] for r in rids]
    while any(r.in_context for r in reqs):
        engine.step()
    for _ in range(3):  # warm: the first generation steps may compile or fill caches
        engine.step()
    counting = engine.target if isinstance(engine.target, HopCounting) else None
    hops0 = dict(counting.hops) if counting is not None else {}
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    for r in rids:
        engine.abort(r)
    engine.drain()
    while engine.has_unfinished():
        engine.step()
    hops = counting.hops if counting is not None else None
    per_step: dict[str, float] = {}
    if hops:
        n = max(hops["steps"] - hops0.get("steps", 0), 1)
        per_step = {k: (hops.get(k, 0.0) - hops0.get(k, 0.0)) / n for k in HOP_KEYS}
    timeline = counting.timeline if counting is not None else None
    row: dict[str, Any] = {"batch": batch, "step_ms": 1e3 * dt, "hops_per_step": per_step}
    if timeline:
        row["timeline_ms"] = segments([r for r in timeline if t0 <= r["sent"] and "next_send" in r])
    return row


def segments(records: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each timeline segment over the steps measured."""
    out: dict[str, float] = {}
    for name, (a, b) in SEGMENTS.items():
        spans = sorted(1e3 * (r[b] - r[a]) for r in records if r.get(a) and r.get(b))
        if spans:
            out[name] = spans[len(spans) // 2]
    return out


def measure_depth(
    args: argparse.Namespace, k: int, shape_dir: Path | None, errors: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every setup at one draft depth, built first and measured in turn; a setup this machine cannot build is
    recorded in `errors` and the rest measured."""
    engines: dict[str, LLMEngine] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name in args.setups:
            try:
                engines[name] = args.build_engine(MTPServeConfig.from_dict(config(args, k, shape_dir), SETUPS[name]))
            except Exception as exc:  # e.g. ray-tp2 on one GPU: say so, measure the rest
                errors.append({"setup": name, "k": k, "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(errors[-1]), file=sys.stderr, flush=True)
        for rep in range(args.repeats):
            for name, engine in engines.items():
                for batch in args.batches:
                    row = {"setup": name, "k": k, "repeat": rep, **measure(engine, batch, args.steps)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rows


def best_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (setup, K, batch): the best step time over repeats, its step rate against in-process
    (in-process ms / this ms; None without an in-process row), hops and timeline."""
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in runs:
        key = (r["setup"], r["k"], r["batch"])
        if key not in best or r["step_ms"] < best[key]["step_ms"]:
            best[key] = r
    out = []
    for (setup, k, batch), r in best.items():
        ref = best.get(("in-process", k, batch))
        out.append(
            {
                "setup": setup,
                "k": k,
                "batch": batch,
                "step_ms": r["step_ms"],
                "vs_in_process": ref["step_ms"] / r["step_ms"] if ref else None,
                "hops": r["hops_per_step"],
                "timeline_ms": r.get("timeline_ms", {}),
            }
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every depth and setup: the report, `results` the best rows, `runs` every measurement."""
    runs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-shape-") as tmp:
        shape_dir: Path | None = None
        if args.shape == "tiny":
            shape_dir = Path(tmp)
            (shape_dir / "config.json").write_text(json.dumps(TINY))
        elif args.shape != "smollm2":
            shape_dir = Path(args.shape)
            if not (shape_dir / "config.json").is_file():
                raise bench_report.BenchError(
                    f"--shape: {args.shape} is not smollm2, tiny or a folder with a config.json"
                )
        for k in args.ks:
            runs += measure_depth(args, k, shape_dir, errors)
        cfg = MTPServeConfig.from_dict(config(args, 0, shape_dir))
    return bench_report.report(
        "distributed",
        bench_report.command_of(args),
        cfg=cfg,
        settings=bench_report.settings_of(args, SETTINGS),
        results=best_rows(runs),
        model={"shape": args.shape, "path": args.model, "draft": args.draft if args.shape == "smollm2" else "random"},
        runs=runs,
        errors=errors,
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Best step time, its rate against in-process and the median timeline segments per row."""
    head = ["setup", "K", "batch", "step ms", "x in-process", *(f"{s} ms" for s in SEGMENTS)]
    body = []
    for r in rows:
        ratio = "-" if r["vs_in_process"] is None else f"{r['vs_in_process']:.2f}"
        t = r["timeline_ms"]
        cells = [r["setup"], str(r["k"]), str(r["batch"]), f"{r['step_ms']:.3f}", ratio]
        body.append(cells + [f"{t[s]:.3f}" if s in t else "-" for s in SEGMENTS])
    return bench_report.table(head, body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Bars of the best step time: one group per (K, batch), one bar per setup."""
    bars: dict[str, dict[str, float]] = {}
    for r in rows:
        bars.setdefault(f"K={r['k']} b={r['batch']}", {})[r["setup"]] = r["step_ms"]
    bench_report.plot_bars(path, bars, title, "ms per decode step (best)")


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench distributed`."""
    return bench_report.run_measurement(args, run, table, plot, title="Ray path against in-process")
