"""TensorRT-LLM PR #18295's three settings on the tiny mimic setup, where a wrong draft KV row shows.

A one-layer random Llama and a head that re-runs its layer (`tests/helpers/tiny.py`) accept most drafts, so the
corrupted rows of `sampled` lookahead cost acceptance visibly: 12 random-token prompts of 64-112 tokens,
chunk 16, K=1, 32 output tokens, CPU fp32.

    python3 bench/probes/mimic_compare.py --json bench/results/tiny_mimic_acceptance_compare.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from mtpserve.cluster.bench import acceptance as bench_acceptance  # noqa: E402
from mtpserve.cluster.bench import report as bench_report  # noqa: E402
from mtpserve.cluster.engine.llm_engine import LLMEngine  # noqa: E402
from tests.helpers.tiny import engine_config, mimic_head, mimic_target, random_prompts  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="where to write the report")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the three settings, print the table, write the report."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    target, weights = mimic_target()
    cfg = engine_config(speculative={"num_draft_tokens": 1, "draft": "mimic"})
    prompts = random_prompts(12, target.vocab_size, [96, 80, 112, 64], seed=0)

    def factory(c: object) -> LLMEngine:
        return LLMEngine.from_weights(c, target, weights, head=mimic_head(target, weights))  # type: ignore[arg-type]

    settings = bench_acceptance.compare_settings(16)
    res = bench_acceptance.run_acceptance_settings(factory, cfg, settings, prompts, max_tokens=32, progress=False)
    print(bench_acceptance.format_acceptance_table(res))
    if args.json:
        run = {"prompts": "12 random-token prompts, 64-112 tokens", "max_tokens": 32, "compare": True}
        doc = bench_acceptance.acceptance_report(
            cfg,
            target,
            res,
            run,
            command=bench_report.command_line(),
            model_label="tests/helpers/tiny.py mimic_target() + mimic_head()",
        )
        doc["command"] = " ".join(["python3 bench/probes/mimic_compare.py", *sys.argv[1:]])
        bench_report.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
