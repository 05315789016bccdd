"""Draft-step kernels and paged attention variants on the GPU, per call, at SmolLM2-135M's shapes:

- norm + lm_head + argmax (`argmax_kernels.norm_argmax`, several vocabulary tiles) against the separate
  norm, cuBLAS projection, fp32 conversion and torch argmax, with token agreement;
- the MTP head's input (`draft_kernels.draft_input`) against embedding + two norms + concat + cuBLAS;
- uniform paged attention at batch 1, 8 and 64, Q = 1 and 4, for several context lengths, with and
  without split key ranges, against float64;
- the matrix-vector kernels (`fused_kernels.norm_linear`, `swiglu_linear`) at 1-32 rows, with the default
  tiles and with the rows in groups of 2 and 4 per program (`GROUP_TILES`), against RMSNorm + cuBLAS, for the
  decoder layer's projections (rows past `GEMV_MAX_ROWS` lift that limit for the probe);
- the tree step's kernels: per-level top-k log-probabilities (`topk_kernels.top_logprobs`) against torch's
  cast, top-k and logsumexp at 32k, 49k and 128k vocabularies, and the greedy walk with its KV moves
  (`tree_kernels.greedy_walk_moves`) against `greedy_walk` on random trees.

Each variant runs 50 times inside one CUDA graph (`graph_us`).

python3 bench/probes/kernel_check.py --out $OUT      # one GPU; writes kernel_check.json
python3 bench/probes/kernel_check.py --groups tree --out $OUT      # the tree step's kernels only
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.modeling import (
    argmax_kernels,
    draft_kernels,
    fused_kernels,
    kernel_choices,
    topk_kernels,
    triton_attention,
)
from mtpserve.modeling.attention import uniform_paged_attention
from mtpserve.modeling.gemv_tiles import GemvTiles
from mtpserve.modeling.kernel_choices import KernelChoices
from mtpserve.modeling.layer_ops import TORCH_OPS, TritonOps
from mtpserve.speculative.tree import greedy_walk
from mtpserve.workers.tree_kernels import greedy_walk_moves

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, BLOCK, MLP = 49152, 576, 9, 3, 64, 16, 1536
REPS = 50
GROUP_TILES = {"g2": GemvTiles(8, 0, group=2), "g4": GemvTiles(8, 0, group=4)}  # timed beside the defaults


def graph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds per call of fn, replayed REPS times inside one captured graph (best of five)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * REPS))
    return best


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
            return draft_kernels.draft_input(
                tokens, hidden, draft_kernels.DraftInputWeights(emb, enw, hnw, 1e-5, eh_proj=w)
            )

        entry = {
            "separate_us": graph_us(separate),
            "fused_us": graph_us(fused),
            "max_abs_diff": (fused().float() - separate().float()).abs().max().item(),
        }
        out[str(rows)] = entry
        print("draft_input", rows, json.dumps(entry), flush=True)
    return out


def attention_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """Uniform paged attention per call, with and without split key ranges, and its error against float64."""
    out: dict[str, object] = {}
    programs0 = triton_attention.SPLIT_PROGRAMS
    shapes = ((1, 1, 128), (1, 1, 1024), (1, 1, 4096), (1, 4, 1024), (8, 1, 4096), (64, 1, 512), (64, 4, 1024))
    for batch, q_len, ctx in shapes:
        blocks_per_seq = -(-ctx // BLOCK)
        n_blocks = batch * blocks_per_seq + 1
        k_cache = torch.randn(n_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(n_blocks - 1, device=dev, generator=g)[: batch * blocks_per_seq].view(batch, -1)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.long)
        q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
        inputs = (q, k_cache, v_cache, tables, lens)
        ref = uniform_paged_attention(
            q.double(), k_cache.double(), v_cache.double(), tables, seq_lens=lens, q_len=q_len, scale=HEAD_DIM**-0.5
        )
        entry: dict[str, object] = {"split_cap": triton_attention.split_cap(batch, KV_HEADS)}
        for name, programs in (("one_range", 0), ("split", programs0)):
            triton_attention.SPLIT_PROGRAMS = programs

            def attend(inputs: tuple[torch.Tensor, ...] = inputs, ql: int = q_len) -> torch.Tensor:
                return triton_attention.triton_uniform_attention(*inputs, ql, HEAD_DIM**-0.5)

            try:
                entry[f"{name}_us"] = graph_us(attend)
                entry[f"{name}_max_abs_err"] = (attend().double() - ref).abs().max().item()
            except Exception as exc:
                entry[f"{name}_error"] = repr(exc)[:300]
            finally:
                triton_attention.SPLIT_PROGRAMS = programs0
        key = f"b{batch}_q{q_len}_ctx{ctx}"
        out[key] = entry
        print("attention", key, json.dumps(entry), flush=True)
    return out


def topk_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """A tree level's top-k log-probabilities: two Triton launches against torch, time and agreement."""
    out: dict[str, object] = {}
    for vocab in (32768, VOCAB, 128256):
        for rows, k in ((1, 4), (4, 4), (16, 4), (64, 4)):
            logits = (4 * torch.randn(rows, vocab, device=dev, generator=g)).to(torch.bfloat16)
            ref_val, ref_idx = TORCH_OPS.top_logprobs(logits, k)
            val, idx = topk_kernels.top_logprobs(logits, k)
            same = idx == ref_idx

            def torch_topk(x: torch.Tensor = logits, k: int = k) -> object:
                return TORCH_OPS.top_logprobs(x, k)

            def triton_topk(x: torch.Tensor = logits, k: int = k) -> object:
                return topk_kernels.top_logprobs(x, k)

            entry: dict[str, object] = {
                "torch_us": graph_us(torch_topk),
                "triton_us": graph_us(triton_topk),
                "max_abs_diff": (val - ref_val).abs().max().item(),
                "same_ids": int(same.sum()),
                "ids": same.numel(),
                "differing_ids_are_ties": bool(
                    torch.equal(logits.float().gather(1, idx)[~same], logits.float().gather(1, ref_idx)[~same])
                ),
            }
            key = f"v{vocab}_rows{rows}_k{k}"
            out[key] = entry
            print("top_logprobs", key, json.dumps(entry), flush=True)
    return out


def walk_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """The greedy walk with its KV moves, one launch, against `greedy_walk` on random trees."""
    same, deep, cases = 0, 0, 200
    for _ in range(cases):
        b, q = int(torch.randint(1, 65, (1,))), int(torch.randint(2, 33, (1,)))
        depth = int(torch.randint(1, q, (1,)))
        parents = (torch.rand(b, q, device=dev, generator=g) * torch.arange(q, device=dev)).long()
        parents[:, 0] = -1
        tokens = torch.randint(0, 4, (b, q), device=dev, generator=g)
        argmax = torch.randint(0, 4, (b, q), device=dev, generator=g)
        slots = torch.randperm(4096, device=dev, generator=g)[: b * q].view(b, q)
        n_acc, path, bonus = greedy_walk(tokens, parents, argmax, depth)
        got = greedy_walk_moves(tokens, parents, argmax, slots, depth=depth)
        accepted = torch.arange(1, depth + 1, device=dev)[None, :] <= n_acc[:, None]
        src = torch.where(accepted, slots.gather(1, path), slots[:, 1 : depth + 1])
        same += bool(
            torch.equal(got[0], n_acc) and torch.equal(got[1], path) and torch.equal(got[2], bonus)
            and torch.equal(got[3], src) and torch.equal(got[4], slots[:, 1 : depth + 1])
        )  # fmt: skip
        deep += int((n_acc >= 2).sum())
    tokens = torch.randint(0, 4, (1, 16), device=dev, generator=g)
    parents = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 2, 2, 5, 5, 7, 9, 9, 11, 12]], device=dev)
    slots = torch.arange(16, device=dev)[None]
    entry: dict[str, object] = {
        "cases": cases,
        "equal": same,
        "accepted_past_level_one": deep,
        "b1_q16_torch_us": graph_us(lambda: greedy_walk(tokens, parents, tokens, 4)),
        "b1_q16_triton_us": graph_us(lambda: greedy_walk_moves(tokens, parents, tokens, slots, depth=4)),
    }
    print("greedy_walk_moves", json.dumps(entry), flush=True)
    return entry


def _gemv_case(
    down: bool, x: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, ops: TritonOps
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], torch.Tensor]:
    """(Triton, cuBLAS, fp32 reference) for SwiGLU + down projection, or RMSNorm + projection."""
    if down:
        ref = F.linear(TORCH_OPS.silu_mul(x).float(), w.float())
        return (lambda: fused_kernels.swiglu_linear(x, w)), (lambda: F.linear(ops.silu_mul(x), w)), ref
    ref = F.linear(TORCH_OPS.add_rms_norm(x.float(), None, nw.float(), 1e-5)[0], w.float())
    return (
        (lambda: fused_kernels.norm_linear(x, None, nw, 1e-5, weight=w)[0]),
        (lambda: F.linear(ops.add_rms_norm(x, None, nw, 1e-5)[0], w)),
        ref,
    )


def gemv_report(dev: str, g: torch.Generator) -> dict[str, object]:
    """Matrix-vector kernels (default tiles, and rows in groups: g2_us, g4_us) against RMSNorm + cuBLAS per row
    count, at the layer's projection shapes."""
    ops = TritonOps()
    built_rows, fused_kernels.GEMV_MAX_ROWS = fused_kernels.GEMV_MAX_ROWS, 32
    nw = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
    shapes = {"qkv": (D, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "gate_up": (D, 2 * MLP), "down": (MLP, D)}
    out: dict[str, object] = {}
    for name, (k, n) in shapes.items():
        w = (0.05 * torch.randn(n, k, device=dev, generator=g)).to(torch.bfloat16)
        for rows in (1, 2, 4, 8, 16, 32):
            x = torch.randn(rows, 2 * k if name == "down" else k, device=dev, generator=g).to(torch.bfloat16)
            triton_fn, cublas_fn, ref = _gemv_case(name == "down", x, nw=nw, w=w, ops=ops)
            got = triton_fn()
            entry = {"triton_us": graph_us(triton_fn), "cublas_us": graph_us(cublas_fn),
                     "max_abs_err_vs_fp32": (got.float() - ref).abs().max().item()}  # fmt: skip
            for label, tiles in GROUP_TILES.items():
                with kernel_choices.in_force(KernelChoices(gemv_tiles={rows: tiles})):
                    entry[f"{label}_us"] = graph_us(triton_fn)
                    entry[f"{label}_max_abs_err_vs_fp32"] = (triton_fn().float() - ref).abs().max().item()
            out[f"{name}_{rows}"] = entry
            print("gemv", name, rows, json.dumps(entry), flush=True)
    fused_kernels.GEMV_MAX_ROWS = built_rows  # the later groups see the kernels as built
    return out


GROUPS: dict[str, Callable[[str, torch.Generator], dict[str, object]]] = {
    "argmax": argmax_report,
    "draft_input": draft_input_report,
    "gemv": gemv_report,
    "attention": attention_report,
    "top_logprobs": topk_report,
    "greedy_walk_moves": walk_report,
}
GROUP_SETS = {"all": list(GROUPS), "tree": ["top_logprobs", "greedy_walk_moves"]}


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--groups", default="all", help=f"comma-separated, of {', '.join([*GROUP_SETS, *GROUPS])}")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    names = [n for group in args.groups.split(",") for n in GROUP_SETS.get(group, [group])]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise SystemExit(f"--groups: unknown {', '.join(unknown)}; choose from {', '.join([*GROUP_SETS, *GROUPS])}")
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0)}
    report.update({n: GROUPS[n](dev, g) for n in names})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = "kernel_check.json" if args.groups == "all" else f"kernel_check_{args.groups.replace(',', '_')}.json"
    (Path(args.out) / name).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
