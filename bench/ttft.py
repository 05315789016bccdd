"""Time to first token by prompt length, alone and while other requests decode (one process, one GPU).

For each engine (target-only and speculative K=3, CUDA graphs, the serving configuration) and each prompt
length, it measures the seconds from `add_request` to the request's first token, taken when the server
would deliver it (`LLMEngine.on_tokens`, before the step's draft runs where the draft runs apart; the
captured prefill step drafts inside the same graph): alone on an idle engine
(three repeats after a warm-up), and with `--busy` other requests already decoding (their short prompts
prefilled first, `ignore_eos`, long enough to outlast the measurement). The KV cache holds all of them,
so no request is preempted, and prefix caching is off (each prompt repeats). It also records how many engine
steps the prefill took, since chunked prefill spreads a long prompt over several steps, and how many of
them replayed the captured prefill step (`model.prefill_graphs`; `--compare-eager-prefill` measures each
K without it too). Prints a table and writes `ttft.json` under --out.

    python3 bench/ttft.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h200 import sync

from cluster.engine import LLMEngine
from workers.builders import DEFAULT_HEAD
from workers.config import MTPServeConfig, SchedulerConfig

BUSY_PROMPT = 32  # tokens in each busy request's prompt


def build(args: argparse.Namespace, k: int, prefill_graphs: bool = True) -> LLMEngine:
    """The serving configuration (`prefill_graphs` off: every prefill step eager), with KV blocks for the
    longest prompt and every busy request at its end (a smaller cache measures preemption, not prefill)."""
    block = 16

    def blocks(n: int) -> int:
        return -(-(n + 2 * k) // block)

    num_blocks = args.busy * blocks(BUSY_PROMPT + args.busy_tokens) + blocks(max(args.lengths) + 1) + 1
    cfg = MTPServeConfig.from_dict(
        {
            "model": {
                "path": args.model,
                "device": args.device,
                "dtype": args.dtype,
                "max_model_len": max(args.lengths) + 256,
                "prefill_graphs": prefill_graphs,
            },
            "scheduler": {
                "max_num_requests": args.busy + 1,
                "max_num_batched_tokens": args.max_batched_tokens,
                "chunk_size": args.chunk_size,
                "block_size": block,
                "num_kv_blocks": num_blocks,
                "prefix_caching": False,  # the same prompt repeats: measure its prefill, not a cache hit
            },
            "speculative": {"enabled": k > 0, "draft": args.head, "num_draft_tokens": max(k, 1)},
        }
    )
    return LLMEngine.from_config(cfg)


def first_token(engine: LLMEngine, prompt: list[int], temperature: float = 0.0) -> tuple[float, int]:
    """(seconds, engine steps) from add_request to the request's first generated token."""
    sync()
    t0 = time.perf_counter()
    params = {"max_tokens": 1, "ignore_eos": True, "temperature": temperature, "top_p": 0.95 if temperature else 1.0}
    rid = engine.add_request(prompt, params)
    seen: list[float] = []

    def first(outs: list[Any]) -> None:  # as the server's engine loop delivers: before the step's draft runs
        if not seen and any(o.request_id == rid and o.new_token_ids for o in outs):
            seen.append(time.perf_counter())

    engine.on_tokens = first
    steps = 0
    while not seen:
        steps += 1
        first(engine.step())
    engine.on_tokens = None
    return seen[0] - t0, steps


def start_busy(engine: LLMEngine, n: int, max_tokens: int) -> list[str]:
    """n requests of short random prompts, stepped until every one is decoding."""
    g = torch.Generator().manual_seed(0)
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    ids = [engine.add_request(torch.randint(10, 1000, (BUSY_PROMPT,), generator=g).tolist(), params) for _ in range(n)]
    reqs = [engine.scheduler.requests[r] for r in ids]
    while any(r.in_context for r in reqs):
        engine.step()
    return ids


def prefill_replays(engine: LLMEngine) -> int | None:
    """CUDA-graph replays of the captured prefill step so far (None without one)."""
    step = getattr(engine.target, "prefill", None)
    return None if step is None else int(step.replays)


def measure(args: argparse.Namespace, k: int, prefill_graphs: bool) -> list[dict[str, Any]]:
    """Rows for one engine: every length, alone and busy."""
    engine = build(args, k, prefill_graphs)
    tag = {"k": k, "prefill_graphs": prefill_graphs}
    g = torch.Generator().manual_seed(1)
    rows = []
    first_token(engine, torch.randint(10, 1000, (64,), generator=g).tolist())  # warm-up
    for n in args.lengths:
        prompt = torch.randint(10, 1000, (n,), generator=g).tolist()
        first_token(engine, prompt, args.temperature)  # the first prompt of a length pays one-off costs
        before = prefill_replays(engine)
        alone = [first_token(engine, prompt, args.temperature) for _ in range(args.repeats)]
        replays = None if before is None else prefill_replays(engine) - before  # type: ignore[operator]
        rows.append(
            {**tag, "prompt_tokens": n, "busy": 0, "ms": [1e3 * t for t, _ in alone], "steps": alone[0][1],
             "prefill_replays": replays}
        )  # fmt: skip
        if args.busy:
            busy_ids = start_busy(engine, args.busy, args.busy_tokens)
            t, steps = first_token(engine, prompt, args.temperature)
            rows.append({**tag, "prompt_tokens": n, "busy": args.busy, "ms": [1e3 * t], "steps": steps})
            for r in busy_ids:
                engine.abort(r)
            while engine.has_unfinished():
                engine.step()
        print(json.dumps(rows[-1]), flush=True)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file or HF Llama directory")
    ap.add_argument("--head", default=str(DEFAULT_HEAD), help="draft head (default: the shipped one)")
    ap.add_argument("--out", default="out", help="folder for ttft.json")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048, 8192])
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    ap.add_argument("--busy", type=int, default=63, help="requests decoding during the busy measurement")
    ap.add_argument("--busy-tokens", type=int, default=1024, help="max_tokens of each busy request (outlasts a run)")
    ap.add_argument("--repeats", type=int, default=3)
    sched = SchedulerConfig()
    ap.add_argument("--chunk-size", type=int, default=sched.chunk_size, help="scheduler.chunk_size (serving default)")
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=sched.max_num_batched_tokens,
        help="scheduler.max_num_batched_tokens (serving default)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the measured prompts sample at this temperature with top-p 0.95 (0: greedy); busy requests stay greedy",
    )
    ap.add_argument(
        "--compare-eager-prefill",
        action="store_true",
        help="also measure every K with model.prefill_graphs off (each prefill step eager)",
    )
    ap.add_argument("--device", default="cuda", help="cpu for a quick dry run")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = [True, False] if args.compare_eager_prefill else [True]
    rows = [row for k in args.ks for graphs in modes for row in measure(args, k, graphs)]
    report = {"command": " ".join(sys.argv), "settings": vars(args), "rows": rows}
    (out_dir / "ttft.json").write_text(json.dumps(report, indent=1))
    print(f"{'K':>2} {'graphs':>6} {'prompt':>7} {'busy':>5} {'TTFT ms (each)':>28} {'steps':>6} {'replays':>7}")
    for r in rows:
        ms = " / ".join(f"{x:.1f}" for x in r["ms"])
        print(
            f"{r['k']:>2} {r['prefill_graphs']!s:>6} {r['prompt_tokens']:>7} {r['busy']:>5} {ms:>28} "
            f"{r['steps']:>6} {r.get('prefill_replays')!s:>7}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
