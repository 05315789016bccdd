"""DeepSeek-V3's real layer shapes with dummy weights and a truncated layer count, on one GPU.

The config is DeepSeek-V3's public config.json (hidden 7168, 128 MLA heads with q rank 1536 and KV rank
512, 256 routed experts of width 2048 with 8 per token in 8 groups, one shared expert, YaRN x40, one MTP
module), with `--dense-layers` dense and `--moe-layers` expert layers (default 1 and 2) instead of 3 and 58.
Weights are `--load-format dummy`: built in place on the GPU. For target-only decoding and for drafting
with the native module (vanilla MTP, K=1; and the module reused as MTP Eagle, K=2), with CUDA graphs, it
measures decode tok/s and step time per batch size and the TTFT of a 512-token prompt; then the MoE grouped
GEMM against a per-expert loop, and GPU memory. Prints a table and writes `deepseek_shapes.json` under --out.

    python3 bench/probes/deepseek_shapes.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.bench.throughput import measure_batch, random_token_prompts, warm_up
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.moe import grouped_linear
from mtpserve.workers.config import MTPServeConfig

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def write_config(directory: Path, dense: int, moe: int) -> Path:
    """The truncated config.json (no weights: the dummy load builds them on the device)."""
    cfg = dict(DEEPSEEK_V3, num_hidden_layers=dense + moe, first_k_dense_replace=dense)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def engine(model_dir: Path, spec: dict[str, Any], max_requests: int, graphs: bool) -> LLMEngine:
    """A serving engine over the dummy weights."""
    cfg = MTPServeConfig.from_dict(
        {
            "model": {
                "path": str(model_dir),
                "load_format": "dummy",
                "device": "cuda",
                "dtype": "bfloat16",
                "max_model_len": 2048,
                "cuda_graphs": graphs,
            },
            "scheduler": {"max_num_requests": max_requests, "max_num_batched_tokens": 1024, "chunk_size": 512},
            "speculative": spec,
        }
    )
    return LLMEngine.from_config(cfg, load_tokenizer=False)


def ttft(eng: LLMEngine, length: int, repeats: int = 3) -> float:
    """Median seconds from add_request to the first token of a `length`-token prompt, alone."""
    times = []
    for i in range(repeats):
        (prompt,) = random_token_prompts(1, length, eng.args.vocab_size, seed=100 + i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = eng.add_request(prompt, {"max_tokens": 2, "ignore_eos": True})
        while True:
            outs = eng.step()
            if any(o.request_id == rid and o.new_token_ids for o in outs):
                break
        times.append(time.perf_counter() - t0)
        while eng.has_unfinished():
            eng.step()
    return sorted(times)[len(times) // 2]


def measure(label: str, eng: LLMEngine, batches: list[int], prompt_len: int, output_len: int) -> dict[str, Any]:
    """Decode figures per batch size, TTFT at 512 tokens and memory for one engine."""
    warm_up(eng, prompt_len, 8)
    rows = []
    for bs in batches:
        prompts = random_token_prompts(bs, prompt_len, eng.args.vocab_size, seed=bs)
        warm_up(eng, prompt_len, 4)
        r = measure_batch(eng, prompts, output_len)
        rows.append(
            {
                "batch": bs,
                "decode_tok_s": r.decode_tok_s,
                "step_ms": r.decode_step_ms,
                "acceptance_length": r.acceptance_length,
            }
        )
        print(f"{label} batch {bs}: {r.decode_tok_s:.0f} tok/s, {r.decode_step_ms:.2f} ms/step", flush=True)
    runner = eng.target
    return {
        "label": label,
        "captured_target_steps": getattr(getattr(runner, "uniform", None), "steps", None) is not None,
        "captured_fused_steps": getattr(runner, "fused", None) is not None,
        "rows": rows,
        "ttft_512_ms": ttft(eng, 512) * 1e3,
        "gpu_mem_allocated_gb": torch.cuda.memory_allocated() / 2**30,
    }


def grouped_gemm_check(hidden: int = 7168, inter: int = 2048, experts: int = 256, tokens: int = 64) -> dict[str, Any]:
    """The grouped GEMM of the routed experts against a per-expert loop: max difference and GPU time."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(tokens * 8, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, experts, (tokens * 8,), device="cuda", generator=g).sort().values
    ones = torch.ones_like(ids, dtype=torch.int32)
    offsets = (
        torch.zeros(experts, dtype=torch.int32, device="cuda").scatter_add_(0, ids, ones).cumsum(0, dtype=torch.int32)
    )

    def grouped() -> torch.Tensor:
        return grouped_linear(x, w, offsets, ids)

    def loop() -> torch.Tensor:
        return torch.cat([x[ids == e] @ w[e].T for e in range(experts)])

    out, ref = grouped(), loop()
    times = {}
    for name, fn in {"grouped": grouped, "loop": loop}.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times[name + "_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    diff = float((out.float() - ref.float()).abs().max())
    return {"max_abs_diff": diff, "ref_abs_max": float(ref.abs().max()), **times}


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=".")
    return ap


def main() -> None:
    """Every configuration in one process; JSON and a table at the end."""
    a = build_parser().parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    model_dir = write_config(Path(tempfile.mkdtemp()) / "deepseek-v3-truncated", a.dense_layers, a.moe_layers)
    result: dict[str, Any] = {"config": json.loads((model_dir / "config.json").read_text()), "runs": []}
    result["grouped_gemm"] = grouped_gemm_check()
    print("grouped GEMM:", result["grouped_gemm"], flush=True)
    variants = [
        ("target-only", {"enabled": False}),
        ("native MTP, K=1", {"draft": "native", "num_draft_tokens": 1, "method": "mtp_vanilla"}),
        (
            "native MTP as MTP Eagle, K=2",
            {"draft": "native", "num_draft_tokens": 2, "method": "mtp_eagle", "adaptive": False},
        ),
    ]
    for label, spec in variants:
        t0 = time.perf_counter()
        try:
            eng = engine(model_dir, spec, max(batches), graphs=True)
            build_s = time.perf_counter() - t0
            run = measure(label, eng, batches, prompt_len=a.prompt_len, output_len=a.output_len)
            run["build_s"] = build_s
        except Exception as exc:  # one failing variant must not hide the others' figures
            run = {"label": label, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            print(label, "failed:", run["error"], flush=True)
        result["runs"].append(run)
        eng = None  # type: ignore[assignment]
        gc.collect()
        torch.cuda.empty_cache()
    out = Path(a.out) / "deepseek_shapes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\nvariant | batch | tok/s | ms/step | AL")
    for run in result["runs"]:
        for r in run.get("rows", []):
            al = r["acceptance_length"] or 1.0
            print(f"{run['label']} | {r['batch']} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {al:.2f}")
        if "ttft_512_ms" in run:
            print(f"{run['label']}: TTFT 512 = {run['ttft_512_ms']:.1f} ms, mem {run['gpu_mem_allocated_gb']:.1f} GB")


if __name__ == "__main__":
    main()
