"""Where does a short prefill step's time go? The step that gives the first token after a cached prefix.

Builds the serving engine (real model, shipped head, prefix caching on), caches a --prefix-len prompt,
then times the one step of a request that shares that prefix and adds --new-tokens tokens: scheduling,
the target (forward, sampling, draft inputs), the draft (KV update over the new rows and the K-chain)
and the update, each with the GPU synchronised, as the mean of --repeats requests. The same step with no
cached prefix (a fresh prompt, chunked) is timed for comparison. One more such step runs under
torch.profiler; its tables go to profile_prefill.txt, the timings to profile_prefill.json under --out.

    python3 bench/profile_prefill.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine import LLMEngine
from workers.builders import DEFAULT_HEAD
from workers.config import MTPServeConfig


def timed_step(engine: LLMEngine) -> dict[str, float]:
    """One non-overlapped engine step, each phase timed with the GPU synchronised (ms)."""
    t: dict[str, float] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan = engine.scheduler.schedule()
    t1 = time.perf_counter()
    out = engine.target.execute(plan)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    drafts = out.draft_outputs
    if drafts is None and engine.draft is not None and out.draft_inputs is not None:
        drafts = engine.draft.propose(out.draft_inputs)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    engine._apply(plan, out, drafts)
    t4 = time.perf_counter()
    t.update(schedule=t1 - t0, target=t2 - t1, draft=t3 - t2, update=t4 - t3, total=t4 - t0)
    return {k: 1e3 * v for k, v in t.items()} | {"rows": sum(len(s.token_ids) for s in plan.seqs)}


def first_step(engine: LLMEngine, prompt: list[int]) -> dict[str, float]:
    """The timed step that admits `prompt` (its cached prefix skipped), then the request is aborted."""
    rid = engine.add_request(prompt, {"max_tokens": 4, "ignore_eos": True})
    row = timed_step(engine)
    engine.abort(rid)
    return row


def mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Field-wise mean."""
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix-len", type=int, default=2032)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": args.model, "device": "cuda", "overlap_steps": False},
            "speculative": {"draft": str(DEFAULT_HEAD)},
            "scheduler": {"num_kv_blocks": 4096},
        }
    )
    engine = LLMEngine.from_config(cfg, load_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    # one token past the prefix is shared too: a block's key covers the token after it
    prefix = torch.randint(10, 40000, (args.prefix_len + 1,), generator=g).tolist()
    engine.generate([prefix], {"max_tokens": 2})  # fills the cache (and compiles the prefill kernels)

    def new() -> list[int]:
        return torch.randint(10, 40000, (args.new_tokens - 1,), generator=g).tolist()

    for _ in range(3):
        first_step(engine, prefix + new())
    cached = mean([first_step(engine, prefix + new()) for _ in range(args.repeats)])
    short = mean([first_step(engine, [7, *new()]) for _ in range(args.repeats)])
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "cached_prefix_then_new_tokens_ms": cached,
        "new_tokens_alone_ms": short,
        "hit_tokens": engine.scheduler.prefix_hit_tokens,
    }
    from torch.profiler import ProfilerActivity, profile

    rid = engine.add_request(prefix + new(), {"max_tokens": 4, "ignore_eos": True})
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_step(engine)
    engine.abort(rid)
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    report["profiled_step"] = {"cuda_kernel_ms": cuda_total, "kernel_launches": launches}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = events.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n"
    tables += events.table(sort_by="self_device_time_total", row_limit=20)
    (out / "profile_prefill.txt").write_text(tables)
    (out / "profile_prefill.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
