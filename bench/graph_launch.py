"""Host cost of launching a captured step: CUDA-graph replay, the buffer fill and the input-advance kernel.

For the captured target-only step and the fused K=3 step (SmolLM2-135M shape, random weights, batch
bucket 1 and 64) it times, on the host, each call of
- `replay` on an idle GPU (synchronised before every call);
- `replay` back to back, so each launch finds the previous replay of the same graph still running;
- `replay` alternating between two buckets' graphs, back to back;
- the buffer fill of one served plan, and the fused step's input-advance kernel launch.

python bench/graph_launch.py --out $OUT          # CUDA only; writes graph_launch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine import LLMEngine
from speculative.sampling import SamplingMode
from workers.config import MTPServeConfig
from workers.uniform_step import fill_step

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip


def host_us(call: Callable[[], object], n: int, sync_each: bool) -> dict[str, float]:
    """Median and mean host microseconds of `n` calls (the GPU synchronised before each one if asked)."""
    times = []
    for _ in range(n):
        if sync_each:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return {"median_us": round(statistics.median(times), 1), "mean_us": round(statistics.fmean(times), 1)}


def probe(k: int, model_dir: str) -> dict[str, object]:
    """Launch costs of one engine's captured step (target-only for k = 0, fused K=k otherwise)."""
    cfg = MTPServeConfig.from_dict({
        "model": {"path": model_dir, "load_format": "dummy", "device": "cuda", "dtype": "bfloat16"},
        "scheduler": {"max_num_requests": 64},
        "speculative": {"enabled": k > 0, "draft": "random", "num_draft_tokens": max(k, 1)},
    })  # fmt: skip
    eng = LLMEngine.from_config(cfg)
    runner = eng.target
    step = runner.fused if k else runner.uniform
    graphs = step.steps.variants[SamplingMode.GREEDY].graphs
    eng.add_request(list(range(100, 164)), {"max_tokens": 400, "ignore_eos": True})
    for _ in range(8):
        eng.step()
    eng.drain()
    req = next(iter(eng.scheduler.requests.values()))
    plan = eng.scheduler.schedule()
    out: dict[str, object] = {"k": k, "kernels_hint": "see profile_step.py for kernel counts"}
    for bucket in (1, 64):
        g = graphs[bucket]
        out[f"b{bucket}_replay_idle"] = host_us(g.replay, 50, True)
        out[f"b{bucket}_replay_back_to_back"] = host_us(g.replay, 50, False)
    g1, g64 = graphs[1], graphs[64]
    flip = [g1, g64]
    out["replay_alternating_b1_b64"] = host_us(lambda: flip.reverse() or flip[0].replay(), 50, False)
    out["fill_b1"] = host_us(lambda: fill_step(step.buffers, plan, 1, None), 200, False)
    if k:
        previous = torch.zeros(64, 2 * k + 3, dtype=torch.long, device="cuda")
        out["advance_b1"] = host_us(lambda: step._advance(1, previous), 200, False)
    out["request_blocks"] = len(req.block_ids)
    eng.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="folder for graph_launch.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this probe needs CUDA")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(SMOLLM2))
    report = [probe(k, str(tmp)) for k in (0, 3)]
    for r in report:
        print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_launch.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
