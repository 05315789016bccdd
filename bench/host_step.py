"""Host time of a served decode step, by phase, on CPU: the engine's own Python and numpy work per step.

The target is a one-layer Llama of width 32, so its forward costs almost nothing, and the captured steps
(target-only and the fused speculative step) run eagerly over their fixed buffers. What is left of a step
is the host work that the GPU engine does around a graph replay: planning, filling the step buffers,
reading results and applying them. The forward itself is measured and subtracted.

python bench/host_step.py --out bench/results            # writes cpu_host_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from profile_step import host_split  # noqa: E402

from cluster.engine import LLMEngine  # noqa: E402
from modeling.model import LlamaArgs, random_llama_weights  # noqa: E402
from speculative.mtp_head import MTPEagleHead  # noqa: E402
from workers.config import MTPServeConfig  # noqa: E402
from workers.fused_step import FusedSpecStep  # noqa: E402
from workers.uniform_step import UniformTargetStep  # noqa: E402

ARGS = LlamaArgs(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=8192, rope_theta=10000.0, eos_token_id=None,
)  # fmt: skip
MAX_BLOCKS = 64


def build(batch: int, k: int) -> LLMEngine:
    """An in-process CPU engine with the fixed-buffer steps the GPU engine captures, run eagerly."""
    weights = random_llama_weights(ARGS, seed=0, std=0.15)
    cfg = MTPServeConfig.model_validate({
        "model": {"device": "cpu", "dtype": "float32"},
        "scheduler": {"num_kv_blocks": 4 * batch * MAX_BLOCKS, "block_size": 16, "max_num_requests": batch},
        "speculative": {"enabled": k > 0, "draft": None, "num_draft_tokens": max(k, 1)},
    })  # fmt: skip
    head = None
    if k:
        head = MTPEagleHead(ARGS)
        head.init_from_target(weights)
    eng = LLMEngine.from_weights(cfg, ARGS, weights, head=head)
    runner = eng.target
    model, cache = runner.model, runner.cache  # type: ignore[attr-defined]
    if k:
        runner.fused = FusedSpecStep(model, cache, eng.draft, k, batch, MAX_BLOCKS, "cpu", use_graphs=False)  # type: ignore[attr-defined,arg-type]
    else:
        runner.uniform = UniformTargetStep(model, cache, 1, batch, MAX_BLOCKS, "cpu", use_graphs=False)  # type: ignore[attr-defined]
    eng._overlap_runner = runner  # type: ignore[assignment]  # the GPU engine overlaps these steps
    return eng


def measure(batch: int, k: int, steps: int) -> dict[str, float]:
    """Mean host ms per served step by phase (`profile_step.host_split`); `host` is the step less its forward."""
    eng = build(batch, k)
    for i in range(batch):
        eng.add_request([1 + (i + j) % 250 for j in range(24)], {"max_tokens": 900, "ignore_eos": True})
    for _ in range(30):
        eng.step()
    out = host_split(eng, steps)  # on CPU the eager forward runs where the GPU replays its graph
    out["host"] = out["host_engine_step"] - out["host_graph_replay"]
    out["launch_other"] = out["host_launch"] - out["host_fill_step"] - out["host_graph_replay"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="folder for cpu_host_step.json")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--ks", default="0,1,3", help="comma-separated draft depths (0: target only)")
    ap.add_argument("--steps", type=int, default=300, help="served steps measured per configuration")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration; each phase keeps its fastest")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. a commit)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    heads = ("K", "batch", "host ms", "plan_ahead", "fill", "launch*", "collect", "apply")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (2, 5, 8, 10, 6, 8, 8, 6), strict=True)))
    for k in map(int, args.ks.split(",")):
        for batch in map(int, args.batches.split(",")):
            runs = [measure(batch, k, args.steps) for _ in range(args.repeats)]
            r = {name: min(run[name] for run in runs) for name in runs[0]}
            rows.append({"k": k, "batch": batch, **{n: round(v, 4) for n, v in r.items()}})
            print(f"{k:>2} {batch:>5} {r['host']:>8.3f} {r['host_plan_ahead']:>10.3f} {r['host_fill_step']:>6.3f} "
                  f"{r['launch_other']:>8.3f} {r['host_collect']:>8.3f} {r['host_apply']:>6.3f}")  # fmt: skip
    print("launch*: launch less its buffer fill and forward; ms per served step, CPU, one thread, fastest run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cpu_host_step.json"
    path.write_text(json.dumps({"label": args.label, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
