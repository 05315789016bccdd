"""Garbage-collector pauses in an engine's step loop, with the start-up heap as it is and frozen
(`mtpserve.workers.heap.freeze_startup_heap`, what every serving process does after start-up): one engine per
variant, each in a fresh process, runs a closed loop of `--streams` requests (each finished request replaced at
once) for `--steps` steps; step times and every collection's duration by generation are printed and saved.

python3 bench/probes/gc_pauses.py --tiny --device cpu --streams 256 --steps 400 --out $OUT   # this machine
python3 bench/probes/gc_pauses.py --model $M --device cuda --streams 256 --steps 2000 --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.modeling.model import LlamaArgs, random_llama_weights
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.heap import freeze_startup_heap

TINY = LlamaArgs(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None,
)  # fmt: skip


def engine(opts: dict[str, Any]) -> LLMEngine:
    """The engine under test: the tiny random Llama, or `--model`."""
    streams = opts["streams"]
    cfg: dict[str, Any] = {
        "model": {"device": opts["device"]},
        "speculative": {"enabled": opts["speculative"]},
        "scheduler": {"max_num_requests": streams, "num_kv_blocks": streams * 24 + 64, "prefix_caching": False},
    }
    if opts["tiny"]:
        cfg["speculative"]["draft"] = "random"
        return LLMEngine.from_weights(MTPServeConfig.from_dict(cfg), TINY, random_llama_weights(TINY, seed=0))
    if opts["model"]:
        cfg["model"]["path"] = opts["model"]
    return LLMEngine.from_config(MTPServeConfig.from_dict(cfg))


def measure(opts: dict[str, Any], frozen: bool) -> dict[str, Any]:
    """In a process of its own: step times and collector pauses of the closed loop."""
    eng = engine(opts)
    rng = random.Random(0)
    vocab = eng.args.vocab_size
    params = SamplingParams(max_tokens=opts["output_len"], ignore_eos=True)
    live: set[str] = set()
    seq = 0
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    def step() -> None:
        nonlocal seq
        while len(live) < opts["streams"]:
            live.add(eng.add_request([rng.randrange(10, vocab) for _ in range(opts["prompt_len"])], params, f"r{seq}"))
            seq += 1
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)

    for _ in range(opts["warmup_steps"]):
        step()
    objects = len(gc.get_objects())
    if frozen:
        freeze_startup_heap("gc_pauses probe")
    gc.callbacks.append(timed)
    times = []
    for _ in range(opts["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    gc.callbacks.remove(timed)
    times.sort()
    by_gen: dict[str, dict[str, float]] = {}
    for gen in range(3):
        ms = [p * 1e3 for g, p in pauses if g == gen]
        by_gen[str(gen)] = {"count": len(ms), "max_ms": max(ms, default=0.0), "total_ms": sum(ms)}
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3  # noqa: E731
    return {
        "frozen": frozen, "tracked_objects_before": objects, "steps": len(times),
        "step_mean_ms": sum(times) / len(times) * 1e3, "step_p50_ms": pick(0.5), "step_p99_ms": pick(0.99),
        "step_max_ms": times[-1] * 1e3, "collections": by_gen,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", help="GGUF file or HF Llama directory (default: the default model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with a random draft head")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--no-speculation", dest="speculative", action="store_false")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=".")
    return p


def main() -> None:
    """Both variants in turn; figures printed and saved as JSON and PNG under --out."""
    args = build_parser().parse_args()
    opts = vars(args)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for frozen in (False, True):
        with ctx.Pool(1) as pool:
            row = pool.apply(measure, (opts, frozen))
        rows.append(row)
        gens = ", ".join(f"gen{g} {c['count']} (max {c['max_ms']:.1f} ms)" for g, c in row["collections"].items())
        print(f"frozen={frozen}: step p50 {row['step_p50_ms']:.2f} p99 {row['step_p99_ms']:.2f} "
              f"max {row['step_max_ms']:.2f} ms; {gens}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "settings": {k: v for k, v in opts.items() if k != "out"}, "rows": rows}
    (out / "gc_pauses.json").write_text(json.dumps(doc, indent=1))
    plot(rows, out / "gc_pauses.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time p50 / p99 / max with and without the frozen heap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = ["step_p50_ms", "step_p99_ms", "step_max_ms"]
    for i, row in enumerate(rows):
        ax.bar([k + 0.4 * i for k in range(3)], [row[k] for k in keys], width=0.4, label=f"frozen={row['frozen']}")
    ax.set_xticks([k + 0.2 for k in range(3)], ["p50", "p99", "max"])
    ax.set_ylabel("step ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
