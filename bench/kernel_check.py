"""Draft-step kernels and paged attention variants on the GPU, per call, at SmolLM2-135M's shapes:

- norm + lm_head + argmax (`argmax_kernels.norm_argmax`, several vocabulary tiles) against the separate
  norm, cuBLAS projection, fp32 conversion and torch argmax, with token agreement;
- the MTP head's input (`draft_kernels.draft_input`) against embedding + two norms + concat + cuBLAS;
- uniform paged attention at batch 1 and 64, Q = 1 and 4, for several context lengths, key tiles and
  loop pipelining depths.

Each variant runs 50 times inside one CUDA graph (bench/gemv_check.py's `graph_us`).

python bench/kernel_check.py --out $OUT      # one GPU; writes kernel_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gemv_check import graph_us
from workers import argmax_kernels, draft_kernels, triton_attention
from workers.layer_ops import TORCH_OPS, TritonOps

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 49152, 576, 9, 3, 64, 16


def argmax_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """Separate vs fused greedy tokens, per row count and vocabulary tile."""
    ops = TritonOps()
    w = (0.05 * torch.randn(VOCAB, D, device=dev, generator=g)).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
    out: dict[str, object] = {}
    for rows in (1, 4, 16):
        x = torch.randn(rows, D, device=dev, generator=g).to(torch.bfloat16)

        def separate(x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(ops.add_rms_norm(x, None, nw, 1e-5)[0], w).float().argmax(-1)

        ref = F.linear(TORCH_OPS.add_rms_norm(x.float(), None, nw.float(), 1e-5)[0], w.float())
        entry: dict[str, object] = {"separate_us": graph_us(separate)}
        for block_n, block_k in ((64, 64), (128, 64), (256, 64), (128, 128)):

            def fused(x: torch.Tensor = x, tile: tuple[int, int] = (block_n, block_k)) -> torch.Tensor:
                return argmax_kernels.norm_argmax(x, nw, 1e-5, w, block_n=tile[0], block_k=tile[1])

            try:
                entry[f"fused_n{block_n}k{block_k}_us"] = graph_us(fused)
                tok = fused()
                entry[f"fused_n{block_n}k{block_k}_same_as_separate"] = torch.equal(tok, separate())
                gap = ref.max(-1).values - ref.gather(1, tok[:, None]).squeeze(1)
                entry[f"fused_n{block_n}k{block_k}_fp32_logit_gap"] = gap.max().item()
            except Exception as exc:  # a tile the compiler cannot fit is reported, not fatal
                entry[f"fused_n{block_n}k{block_k}_error"] = repr(exc)[:300]
        out[str(rows)] = entry
        print("argmax", rows, json.dumps(entry), flush=True)
    return out


def draft_input_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """Separate vs fused MTP head input, per row count."""
    ops = TritonOps()
    emb = (0.05 * torch.randn(VOCAB, D, device=dev, generator=g)).to(torch.bfloat16)
    enw, hnw = ((1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16) for _ in range(2))
    w = (0.05 * torch.randn(D, 2 * D, device=dev, generator=g)).to(torch.bfloat16)
    out: dict[str, object] = {}
    for rows in (1, 4):
        tokens = torch.randint(0, VOCAB, (rows,), device=dev, generator=g)
        hidden = torch.randn(rows, D, device=dev, generator=g).to(torch.bfloat16)

        def separate(tokens: torch.Tensor = tokens, hidden: torch.Tensor = hidden) -> torch.Tensor:
            e = ops.add_rms_norm(F.embedding(tokens, emb), None, enw, 1e-5)[0]
            h = ops.add_rms_norm(hidden, None, hnw, 1e-5)[0]
            return F.linear(torch.cat([e, h], dim=-1), w)

        def fused(tokens: torch.Tensor = tokens, hidden: torch.Tensor = hidden) -> torch.Tensor:
            return draft_kernels.draft_input(tokens, emb, enw, hidden, hnw, 1e-5, w)

        entry = {
            "separate_us": graph_us(separate),
            "fused_us": graph_us(fused),
            "max_abs_diff": (fused().float() - separate().float()).abs().max().item(),
        }
        out[str(rows)] = entry
        print("draft_input", rows, json.dumps(entry), flush=True)
    return out


def attention_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """Uniform paged attention per call for batch, Q, context, key tile and pipelining depth."""
    out: dict[str, object] = {}
    tile0, stages0 = triton_attention.UNIFORM_TILE, triton_attention.UNIFORM_STAGES
    for batch, q_len, ctx in ((1, 1, 128), (1, 1, 1024), (1, 4, 512), (64, 1, 512)):
        blocks_per_seq = -(-ctx // BLOCK)
        n_blocks = batch * blocks_per_seq + 1
        k_cache = torch.randn(n_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(n_blocks - 1, device=dev, generator=g)[: batch * blocks_per_seq].view(batch, -1)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.long)
        q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
        entry: dict[str, object] = {}
        for tile in (64, 128, 256):
            for stages in (None, 2):
                triton_attention.UNIFORM_TILE, triton_attention.UNIFORM_STAGES = tile, stages

                def attend(
                    inputs: tuple[torch.Tensor, ...] = (q, k_cache, v_cache, tables, lens), ql: int = q_len
                ) -> torch.Tensor:
                    return triton_attention.triton_uniform_attention(*inputs, ql, HEAD_DIM**-0.5)

                try:
                    entry[f"tile{tile}_stages{stages}_us"] = graph_us(attend)
                except Exception as exc:
                    entry[f"tile{tile}_stages{stages}_error"] = repr(exc)[:300]
                finally:
                    triton_attention.UNIFORM_TILE, triton_attention.UNIFORM_STAGES = tile0, stages0
        key = f"b{batch}_q{q_len}_ctx{ctx}"
        out[key] = entry
        print("attention", key, json.dumps(entry), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "argmax": argmax_report(dev, g),
        "draft_input": draft_input_report(dev, g),
        "attention": attention_report(dev, g),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernel_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
