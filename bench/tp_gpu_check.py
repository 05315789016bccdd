"""TP=2 over NCCL on two GPUs: logits equal TP=1 within bf16 tolerance, and eager step times.

python bench/tp_gpu_check.py --out $OUT      # SmolLM2-135M shape, random weights, needs 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modeling.attention import AttentionMetadata
from modeling.model import LlamaArgs, LlamaModel, random_llama_weights
from modeling.parallel import TPContext
from workers.distributed import free_port, init_tp_group

ARGS = LlamaArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=2048,
                 tie_word_embeddings=True)  # fmt: skip


def run(rank: int, world: int, master: str, q: mp.Queue) -> None:
    """Prefill 64 tokens, time 50 decode steps, return logits of the last step (rank 0)."""
    dev = f"cuda:{rank}"
    tp = init_tp_group(rank, world, master, dev) if world > 1 else TPContext()
    model = LlamaModel(ARGS, tp)
    model.load_hf_state_dict(random_llama_weights(ARGS, seed=0))
    model = model.to(dev, torch.bfloat16).eval()
    cache = model.allocate_cache(64, 16, dev)
    table = [list(range(8))]
    with torch.no_grad():
        ids = torch.arange(100, 164, device=dev)
        h = model(ids, torch.arange(64, device=dev), cache, AttentionMetadata.build([0], [64], table, 16, dev))
        first = model.logits(h[-1:]).float().cpu()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for i in range(50):
            meta = AttentionMetadata.build([64 + i], [1], table, 16, dev)
            model(torch.tensor([7], device=dev), torch.tensor([64 + i], device=dev), cache, meta)
        torch.cuda.synchronize(dev)
        step_ms = 1e3 * (time.perf_counter() - t0) / 50
    if rank == 0:
        q.put((first.tolist(), step_ms))
    if world > 1:
        torch.distributed.destroy_process_group()


def launch(world: int) -> tuple[torch.Tensor, float]:
    """Run `world` ranks; return rank 0's logits and step time."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=run, args=(r, world, master, q)) for r in range(world)]
    for p in procs:
        p.start()
    logits, ms = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return torch.tensor(logits), ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    ref, t1 = launch(1)
    got, t2 = launch(2)
    report = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "max_abs_logit_diff_tp2_vs_tp1": (got - ref).abs().max().item(),
        "logit_scale": ref.abs().max().item(),
        "argmax_equal": bool(got.argmax() == ref.argmax()),
        "eager_decode_step_ms": {"tp1": t1, "tp2": t2},
    }
    print(json.dumps(report, indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tp_gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
