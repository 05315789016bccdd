"""Why some greedy bf16 runs emit other tokens than target-only: a near tie, or a bug?

Greedy speculation is lossless in exact arithmetic. In bf16 the verify step runs the target over K+1 rows
(and eager runs take other kernels than captured ones), so its logits round differently from the
target-only step's one row. Where the target's two best tokens are nearly tied, that can flip the argmax,
and from then on the two outputs differ. A bug would show as a divergence where the target clearly
prefers one token.

For each configuration and each prompt (batch 1, the prompts of `bench/h200.py`), this finds the first
token where the output leaves the target-only captured run, then scores the shared prefix with the target
in fp32 (HF transformers on the same weights): the logits of the two tokens chosen, their gap, and the
fp32 winner. Prints a table and writes `bf16_ties.json` under --out.

    python3 bench/bf16_ties.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
    python3 bench/bf16_ties.py --model ... --trees "tree K=3 N=8 w=3,tree K=4 N=16 w=4" --out $OUT   # draft trees
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h200 import PROMPTS, decode_run, engine_for
from trees import CONFIGS as TREE_CONFIGS
from trees import build as tree_engine

from cluster.engine import LLMEngine
from modeling.loader import resolve_model
from workers.builders import DEFAULT_HEAD

# (label, k, graphs, fused): the rows of bench/h200.py that reported unequal outputs, and their neighbours
CONFIGS = [
    ("K=1 graphs", 1, True, True),
    ("K=3 graphs", 3, True, True),
    ("K=4 graphs", 4, True, True),
    ("target-only eager Triton", 0, False, True),
    ("K=3 eager Triton", 3, False, True),
]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the token lists differ (None if equal over the shorter one)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def fp32_scorer(model_path: str, device: str) -> Any:
    """A function from a token-id prefix to the target's fp32 next-token logits (HF transformers)."""
    from transformers import AutoModelForCausalLM

    directory = resolve_model(model_path).directory
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).to(device).eval()

    @torch.no_grad()
    def score(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prefix], device=device)
        return hf(input_ids=ids).logits[0, -1].float().cpu()

    return score


def tie_row(score: Any, prompt: list[int], ref: list[int], out: list[int], at: int) -> dict[str, Any]:
    """The fp32 view of one divergence: both tokens' logits, their gap and the fp32 top-2."""
    logits = score(prompt + ref[:at])
    top = torch.topk(logits, 2)
    a, b = ref[at], out[at]
    return {
        "position": at,
        "target_only_token": a,
        "other_token": b,
        "fp32_logit_target_only_token": float(logits[a]),
        "fp32_logit_other_token": float(logits[b]),
        "fp32_gap": float(logits[a] - logits[b]),
        "fp32_top2": [int(t) for t in top.indices],
        "fp32_top2_gap": float(top.values[0] - top.values[1]),
        "other_token_is_fp32_top2": b in [int(t) for t in top.indices],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file or HF Llama directory")
    ap.add_argument("--head", default=str(DEFAULT_HEAD), help="draft head (default: the shipped one)")
    ap.add_argument("--out", default="out", help="folder for bf16_ties.json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu for a quick dry run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the benchmark prompts")
    ap.add_argument("--trees", help="comma-separated tree configurations of bench/trees.py instead of the chains")
    ap.add_argument("--load-format", default="auto", help="model.load_format of the tree engines")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    base = engine_for(args, 0, True, 1)
    prompts = [base.encode_prompt(p) for p in PROMPTS[: args.prompts]]
    ref = [decode_run(base, [p], args.max_tokens)["outputs"][0] for p in prompts]
    del base
    outputs: dict[str, list[list[int]]] = {}
    builders: list[tuple[str, Callable[[], LLMEngine]]]
    if args.trees:
        builders = [(n, lambda n=n: tree_engine(args, TREE_CONFIGS[n], 1)) for n in args.trees.split(",")]
    else:
        builders = [(c[0], lambda c=c: engine_for(args, c[1], c[2], 1, c[3])) for c in CONFIGS]
    for label, make in builders:
        eng = make()
        outputs[label] = [decode_run(eng, [p], args.max_tokens)["outputs"][0] for p in prompts]
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    score = fp32_scorer(args.model, args.device)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "head": args.head, "max_tokens": args.max_tokens}
    rows = []
    for label, outs in outputs.items():
        for i, (r, o) in enumerate(zip(ref, outs, strict=True)):
            at = first_divergence(r, o)
            row: dict[str, Any] = {"config": label, "prompt": i, "equal": at is None and len(r) == len(o)}
            if at is not None:
                row.update(tie_row(score, prompts[i], r, o, at))
            rows.append(row)
    report["rows"] = rows
    (out_dir / "bf16_ties.json").write_text(json.dumps(report, indent=1))

    print(f"{'config':26} {'prompt':>6} {'diverges at':>11} {'fp32 gap':>9} {'top-2 gap':>9} {'in top-2':>8}")
    for r in rows:
        if r["equal"]:
            print(f"{r['config']:26} {r['prompt']:>6} {'-':>11}")
        elif "position" in r:
            print(
                f"{r['config']:26} {r['prompt']:>6} {r['position']:>11} {r['fp32_gap']:>9.4f} "
                f"{r['fp32_top2_gap']:>9.4f} {r['other_token_is_fp32_top2']!s:>8}"
            )
        else:
            print(f"{r['config']:26} {r['prompt']:>6} {'length':>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
