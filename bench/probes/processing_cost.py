"""What logit rules, logprobs and structured outputs cost a batch: one in-process engine decodes `--batch` requests of
`--max-tokens` tokens with no extras, then with each extra on every request, then with it on one request only
(the rest plain), for target-only and K=3; tok/s and the share of steps that ran eagerly are printed and saved.

python3 bench/probes/processing_cost.py --model $M --batch 64 --max-tokens 128 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
EXTRAS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs 5": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3},
    "json_schema": {"grammar": GrammarSpec("json_schema", json.dumps(SCHEMA))},
}


def run(engine: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, float]:
    """Decode tok/s of the batch, from the first step after every request has its first token."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    while any(not engine.scheduler.requests[r].output_token_ids for r in ids if r in engine.scheduler.requests):
        engine.step()
    done = {r: len(engine.scheduler.requests[r].output_token_ids) for r in ids}
    steps0 = engine.steps_run
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o.num_output_tokens
    dt = time.perf_counter() - t0
    tokens = sum(done.values()) - len(ids)
    return {"tok_s": round(tokens / dt, 1), "steps": engine.steps_run - steps0, "seconds": round(dt, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", default="0,3")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        spec = {"enabled": k > 0, "num_draft_tokens": max(k, 1), "adaptive": False}
        cfg = MTPServeConfig.from_dict({"model": {"path": args.model, "device": args.device}, "speculative": spec})
        engine = LLMEngine.from_config(cfg)
        engine.warm_up()
        prompts = [engine.encode_prompt(f"Describe person number {i} as JSON.") for i in range(args.batch)]
        base = {"max_tokens": args.max_tokens, "ignore_eos": True}
        run(engine, prompts, [base] * args.batch)  # warm the shapes
        for name, extra in EXTRAS.items():
            for scope in ("all", "one") if extra else ("all",):
                params = [{**base, **extra} if scope == "all" or i == 0 else base for i in range(args.batch)]
                if "grammar" in extra:  # a grammar ends the text when complete: keep the other requests' length
                    params = [{**q, "ignore_eos": False} if "grammar" in q else q for q in params]
                row = {"k": k, "extra": name, "on": scope, **run(engine, prompts, params)}
                rows.append(row)
                print(json.dumps(row))
        engine.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "processing_cost.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"{'K':>2} {'extra':<12} {'on':<4} {'tok/s':>9} {'steps':>6}")
    for r in rows:
        print(f"{r['k']:>2} {r['extra']:<12} {r['on']:<4} {r['tok_s']:>9} {r['steps']:>6}")


if __name__ == "__main__":
    main()
