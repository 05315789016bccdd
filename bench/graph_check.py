"""CUDA-graph replay vs eager: target logits of generation steps (Q = 1 and 4 rows per request).

python bench/graph_check.py --out $OUT     # SmolLM2-135M shape, random bf16 weights, one GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proto.messages import SeqPlan, StepPlan
from workers.attention import AttentionMetadata
from workers.model import LlamaArgs, LlamaModel, random_llama_weights
from workers.runner import TargetRunner, UniformTargetStep

ARGS = LlamaArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=2048,
                 tie_word_embeddings=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    weights = random_llama_weights(ARGS, seed=0, std=0.05)
    model = LlamaModel(ARGS)
    model.load_hf_state_dict(weights)
    model = model.to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    cache = model.allocate_cache(256, 16, dev)
    ref_model = LlamaModel(ARGS)
    ref_model.load_hf_state_dict(weights)
    ref_model = ref_model.to(dev, torch.float32).eval()
    ref_cache = ref_model.allocate_cache(256, 16, dev)
    report = {}
    g = torch.Generator().manual_seed(0)
    lens = [40, 75, 130]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(len(lens))]
    with torch.no_grad():
        for i, n in enumerate(lens):  # prefill three sequences eagerly
            ids = torch.randint(0, ARGS.vocab_size, (n,), generator=g).to(dev)
            meta = AttentionMetadata.build([0], [n], [tables[i]], 16, dev)
            model(ids, torch.arange(n, device=dev), cache, meta)
            ref_model(ids, torch.arange(n, device=dev), ref_cache, meta)
        for q in (1, 4):
            uniform = UniformTargetStep(model, cache, q, 8, 20, dev)
            uniform.capture()
            toks = [torch.randint(0, ARGS.vocab_size, (q,), generator=g).tolist() for _ in lens]
            plan = StepPlan(1, [SeqPlan(f"r{i}", toks[i], lens[i], tables[i], False, True, -1, q - 1)
                                for i in range(len(lens))], q - 1)  # fmt: skip
            bucket = uniform.bucket_for(plan)
            graph_hidden, _, _ = uniform.run(plan, bucket, None)  # type: ignore[arg-type]
            graph_logits = model.logits(graph_hidden.clone()).float()
            eager = TargetRunner(model, cache, dev)
            hidden = eager.forward(plan)
            eager_logits = model.logits(hidden).float()
            diff = (graph_logits - eager_logits).abs().max().item()
            ref_logits = ref_model.logits(TargetRunner(ref_model, ref_cache, dev).forward(plan)).float()
            report[f"q{q}"] = {
                "bucket": bucket,
                "replays": uniform.replays,
                "max_abs_logit_diff": diff,
                "logit_scale": eager_logits.abs().max().item(),
                "argmax_equal_rows": int((graph_logits.argmax(-1) == eager_logits.argmax(-1)).sum()),
                "fp32_eager_vs_graph_max_abs": (graph_logits - ref_logits).abs().max().item(),
                "fp32_eager_vs_bf16_eager_max_abs": (eager_logits - ref_logits).abs().max().item(),
                "argmax_equal_fp32_vs_graph": int((graph_logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
                "argmax_equal_fp32_vs_eager": int((eager_logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
                "rows": int(eager_logits.shape[0]),
            }
    print(json.dumps(report, indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "graph_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
