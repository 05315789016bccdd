"""CUDA-graph replay vs eager, fused vs plain ops, bf16 vs fp32: target logits of generation steps
(Q = 1 and 4 rows per request) after a ragged prefill.

python bench/graph_check.py --out $OUT     # SmolLM2-135M shape, random bf16 weights, one GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modeling.attention import AttentionMetadata, ragged_metadata
from modeling.kv_cache import KVCache
from modeling.model import LlamaArgs, LlamaModel, random_llama_weights
from speculative.messages import SeqPlan, StepPlan
from workers.builders import build_target
from workers.runner import TargetRunner
from workers.uniform_step import UniformTargetStep

ARGS = LlamaArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=2048,
                 tie_word_embeddings=True)  # fmt: skip


def forward_plan(model: LlamaModel, cache: KVCache, plan: StepPlan, dense: bool) -> torch.Tensor:
    """Eager hidden states of a plan: masked SDPA (dense) or the serving path's ragged metadata."""
    dev = cache.keys[0].device
    ids = torch.tensor([t for s in plan.seqs for t in s.token_ids], device=dev)
    positions = torch.cat([torch.arange(s.start, s.end) for s in plan.seqs]).to(dev)
    build = AttentionMetadata.build if dense else ragged_metadata
    meta = build(
        [s.start for s in plan.seqs], [len(s.token_ids) for s in plan.seqs], [s.block_ids for s in plan.seqs], 16, dev
    )
    return model(ids, positions, cache, meta)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    weights = random_llama_weights(ARGS, seed=0, std=0.05)
    low = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_target(ARGS, weights, low, dev)  # the serving model: fused weights, Triton layer kernels
    plain = LlamaModel(ARGS)  # same dtype, plain torch ops, separate projections
    plain.load_hf_state_dict(weights)
    plain = plain.to(dev, low).eval()
    ref_model = LlamaModel(ARGS)
    ref_model.load_hf_state_dict(weights)
    ref_model = ref_model.to(dev, torch.float32).eval()
    caches = [m.allocate_cache(256, 16, dev) for m in (model, plain, ref_model)]
    cache, plain_cache, ref_cache = caches
    report: dict[str, object] = {"ops": model.layers[0].self_attn.ops.name}  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    lens = [40, 75, 130]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(len(lens))]
    with torch.no_grad():
        prefill = StepPlan(0, [SeqPlan(f"r{i}", torch.randint(0, ARGS.vocab_size, (n,), generator=g).tolist(), 0,
                                       tables[i], True, True, -1, 0) for i, n in enumerate(lens)], 0)  # fmt: skip
        for m, c, dense in ((model, cache, False), (plain, plain_cache, True), (ref_model, ref_cache, True)):
            forward_plan(m, c, prefill, dense)  # prefill three sequences eagerly, as one ragged batch
        for q in (1, 4):
            uniform = UniformTargetStep(model, cache, q, 8, 20, dev)
            uniform.steps.capture()
            toks = [torch.randint(0, ARGS.vocab_size, (q,), generator=g).tolist() for _ in lens]
            plan = StepPlan(1, [SeqPlan(f"r{i}", toks[i], lens[i], tables[i], False, True, -1, q - 1)
                                for i in range(len(lens))], q - 1)  # fmt: skip
            bucket = uniform.bucket_for(plan)
            graph_hidden, _ = uniform.run(plan, bucket, None)  # type: ignore[arg-type]
            graph_logits = model.logits(graph_hidden.clone()).float()
            eager_logits = model.logits(TargetRunner(model, cache, dev).forward(plan)).float()
            plain_logits = plain.logits(forward_plan(plain, plain_cache, plan, True)).float()
            ref_logits = ref_model.logits(forward_plan(ref_model, ref_cache, plan, True)).float()

            def diff(a: torch.Tensor, b: torch.Tensor) -> float:
                return (a - b).abs().max().item()

            def same(a: torch.Tensor, b: torch.Tensor) -> int:
                return int((a.argmax(-1) == b.argmax(-1)).sum())

            report[f"q{q}"] = {
                "bucket": bucket,
                "replays": uniform.steps.replays,
                "max_abs_logit_diff": diff(graph_logits, eager_logits),
                "logit_scale": eager_logits.abs().max().item(),
                "argmax_equal_rows": same(graph_logits, eager_logits),
                "fused_vs_plain_max_abs": diff(eager_logits, plain_logits),
                "fp32_eager_vs_graph_max_abs": diff(graph_logits, ref_logits),
                "fp32_eager_vs_bf16_eager_max_abs": diff(eager_logits, ref_logits),
                "fp32_eager_vs_bf16_plain_max_abs": diff(plain_logits, ref_logits),
                "argmax_equal_fp32_vs_graph": same(graph_logits, ref_logits),
                "argmax_equal_fp32_vs_eager": same(eager_logits, ref_logits),
                "argmax_equal_fp32_vs_plain": same(plain_logits, ref_logits),
                "rows": int(eager_logits.shape[0]),
            }
    print(json.dumps(report, indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "graph_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
