"""Ray path vs in-process engine: decode step time at several batch sizes, with the per-hop breakdown.

    python bench/distributed.py --device cpu --shape tiny --json bench/results/cpu_distributed.json
    python bench/distributed.py --device cuda --shape smollm2 --json $OUT/distributed_smollm2.json
    python bench/distributed.py --device cuda --shape ../shared/device/llama3-8b --json $OUT/distributed_8b.json

Every setup runs target-only and with K draft tokens over the same prompt; per depth all setups are built
first and measured in turn, `--repeats` times, and the best of each row is kept.
`--shape smollm2` loads the real SmolLM2 and its shipped head; `tiny` (hidden 128, 4 layers) and a
directory holding a config.json load random weights and a random head (timing only: a random head
accepts almost nothing, so K=3 steps there cost drafting without its gain).

Setups: `in-process` (the engine in this process), `ray-tp1` (a scheduler-side engine and one target
worker actor with the draft colocated, steps over the Unix-socket link, decode steps queued ahead),
`ray-tp1-sync` (the same, every step answered before the next is planned: the per-hop timeline),
`ray-tp1-grpc` (the gRPC stream instead of the socket), `ray-tp2`, `ray-tp2-separate` (plus a draft
worker actor). Per Ray step the timeline follows one step through both processes (`SEGMENTS`: to the rank, queued on
the device, results read, reply encoded, back to the scheduler, the scheduler's turn until its next
send), as medians; `hops_per_step` adds the scheduler's encode/decode and wait and the bytes per hop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.distributed.build import build_engine
from cluster.engine.llm_engine import LLMEngine
from workers.config import MTPServeConfig

HEAD = Path(__file__).resolve().parent.parent / "speculative" / "heads" / "smollm2-135m-mtp.safetensors"
PROMPT = "Write a few sentences about why the ocean is salty."
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
}  # fmt: skip
SETUPS: dict[str, dict[str, Any]] = {
    "in-process": {},
    "ray-tp1": {"parallel.distributed": True, "parallel.draft_placement": "colocated"},
    "ray-tp1-sync": {"parallel.distributed": True, "model.overlap_steps": False},
    "ray-tp1-grpc": {"parallel.distributed": True, "parallel.step_transport": "grpc"},
    "ray-tp2": {"parallel.tp_size": 2, "parallel.draft_placement": "colocated"},
    "ray-tp2-separate": {"parallel.tp_size": 2, "parallel.draft_placement": "separate"},
}
HOP_KEYS = ("wait_s", "worker_s", "transit_s", "encode_s", "decode_s", "plan_bytes", "output_bytes", "draft_hop_s")


def measure(engine: LLMEngine, batch: int, steps: int) -> dict[str, Any]:
    """Mean wall time of generation steps (after every prompt is prefilled), and the hop counters per step."""
    ids = engine.encode_prompt(PROMPT) if engine.tokenizer is not None else list(range(10, 40))
    rids = [engine.add_request(ids, {"max_tokens": 4 * steps + 16, "ignore_eos": True}) for _ in range(batch)]
    reqs = [engine.scheduler.requests[r] for r in rids]
    while any(r.in_context for r in reqs):
        engine.step()
    for _ in range(3):  # warm: the first generation steps may compile or fill caches
        engine.step()
    hops0 = dict(getattr(engine.target, "hops", {}))
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    for r in rids:
        engine.abort(r)
    engine.drain()
    while engine.has_unfinished():
        engine.step()
    hops = getattr(engine.target, "hops", None)
    per_step: dict[str, float] = {}
    if hops:
        n = max(hops["steps"] - hops0.get("steps", 0), 1)
        per_step = {k: (hops.get(k, 0.0) - hops0.get(k, 0.0)) / n for k in HOP_KEYS}
    timeline = getattr(engine.target, "timeline", None)
    row: dict[str, Any] = {"batch": batch, "step_ms": 1e3 * dt, "hops_per_step": per_step}
    if timeline:
        row["timeline_ms"] = segments([r for r in timeline if t0 <= r["sent"] and "next_send" in r])
    return row


SEGMENTS = {  # one answered step's path, in the order it happens (both hosts' perf_counter clocks agree)
    "to_rank": ("sent", "t_received"),  # scheduler encodes and sends, the rank's link thread wakes and reads
    "rank_queue": ("t_received", "t_queued"),  # the rank decodes, checks and queues (launch) or starts it
    "rank_device": ("t_queued", "t_done"),  # queued until its results are read (device time, and for a queued
    # step also the next message's wait and queueing)
    "rank_reply": ("t_done", "t_replied"),  # the rank encodes its answer
    "to_scheduler": ("t_replied", "got"),  # the answer crosses back and the scheduler decodes it
    "scheduler_turn": ("got", "next_send"),  # the scheduler applies the step, plans and encodes the next
}


def segments(records: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each timeline segment over the steps measured."""
    out: dict[str, float] = {}
    for name, (a, b) in SEGMENTS.items():
        spans = sorted(1e3 * (r[b] - r[a]) for r in records if r.get(a) and r.get(b))
        if spans:
            out[name] = spans[len(spans) // 2]
    return out


def config(args: argparse.Namespace, k: int) -> dict[str, Any]:
    """The base config of every setup for one draft depth (0 = target-only)."""
    base: dict[str, Any] = {
        "model": {"device": args.device, "path": args.model, "max_model_len": 2048},
        "scheduler": {"max_num_requests": max(args.batches), "prefix_caching": False},
        "speculative": {"num_draft_tokens": max(k, 1), "enabled": k > 0, "draft": args.head},
    }
    if args.shape != "smollm2":
        path = Path(args.shape)
        if args.shape == "tiny":
            path = Path(tempfile.mkdtemp())
            (path / "config.json").write_text(json.dumps(TINY))
        base["model"].update(path=str(path), load_format="dummy")
        base["speculative"]["draft"] = "random"
    if args.enforce_eager:
        base["model"]["cuda_graphs"] = False
    return base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shape", default="tiny", help="smollm2 (real weights), tiny, or a directory with a config.json")
    ap.add_argument("--model", default=None, help="with --shape smollm2: a GGUF or HF dir (default: the packaged one)")
    ap.add_argument("--head", default=str(HEAD), help="with --shape smollm2: the draft head file")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per row")
    ap.add_argument("--batches", default="1,16", help="comma list of batch sizes")
    ap.add_argument("--ks", default="0,3", help="comma list of draft depths (0 = target-only)")
    ap.add_argument("--setups", default="in-process,ray-tp1", help=f"comma list of {', '.join(SETUPS)}")
    ap.add_argument("--repeats", type=int, default=1, help="measure each row this many times (alternating setups)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--json", default="bench/results/cpu_distributed.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for k in (int(x) for x in args.ks.split(",")):
        engines: dict[str, LLMEngine] = {}
        for name in (s.strip() for s in args.setups.split(",")):
            try:
                engines[name] = build_engine(MTPServeConfig.from_dict(config(args, k), SETUPS[name]))
            except Exception as exc:  # a setup this machine cannot run: say so, measure the rest
                errors.append({"setup": name, "k": k, "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(errors[-1]), flush=True)
        try:
            for rep in range(args.repeats):  # setups alternate, so a slow moment of the host hits them alike
                for name, engine in engines.items():
                    for batch in args.batches:
                        r = measure(engine, batch, args.steps)
                        r.update(setup=name, k=k, repeat=rep)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
        finally:
            for engine in engines.values():
                engine.shutdown()
    report = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "shape": args.shape,
        "rows": rows,
        "errors": errors,
        "summary": summary(rows),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print("\nsetup | K | batch | step ms (best) | x in-process | median ms: " + " | ".join(SEGMENTS))
    for s in report["summary"]:
        t = s["timeline_ms"]
        cells = [s["setup"], str(s["k"]), str(s["batch"]), f"{s['step_ms']:.3f}", f"{s['vs_in_process']:.2f}"]
        cells += [f"{t[key]:.3f}" if key in t else "-" for key in SEGMENTS]
        print(" | ".join(cells))
    return 0


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (setup, K, batch): the best step time over repeats, and its ratio to in-process (step rate)."""
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["setup"], r["k"], r["batch"])
        if key not in best or r["step_ms"] < best[key]["step_ms"]:
            best[key] = r
    out = []
    for (setup, k, batch), r in best.items():
        ref = best.get(("in-process", k, batch))
        ratio = ref["step_ms"] / r["step_ms"] if ref else float("nan")
        out.append({"setup": setup, "k": k, "batch": batch, "step_ms": r["step_ms"], "vs_in_process": ratio,
                    "hops": r["hops_per_step"], "timeline_ms": r.get("timeline_ms", {})})  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
