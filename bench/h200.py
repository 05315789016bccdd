"""One-process GPU benchmark: target-only and speculative decoding at batch 1/8/64, HF peer, TTFT, checks.

Usage (on the GPU machine, from the repo root):
    python bench/h200.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
Prints a table last and writes h200_bench.json (+ h200_bench.png) under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine import LLMEngine
from modeling import fused_kernels
from modeling.layer_ops import TritonOps
from speculative.sampling import SamplingMode
from workers.builders import DEFAULT_HEAD, build_chain_graphs
from workers.config import MTPServeConfig

WEIGHT_FLOOR_MS = 0.063


def sync() -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


PROMPTS = [
    "Explain how a hash map works and when it is a poor choice.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me a recipe for a simple vegetable soup.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "How do I reverse a linked list in Python? Show code.",
    "Describe the water cycle to a ten-year-old.",
    "List five tips for improving sleep quality.",
]


VARIANTS = {
    "": "the serving configuration",
    "no-gemv": "Triton layer kernels, but none of the small-step kernels (matrix-vector projections with the "
    "norm/SwiGLU folded in, the greedy-token kernel and the MTP-input kernel)",
    "no-overlap": "target-only steps read their tokens before the next step is queued (model.overlap_steps off)",
    "no-overlap-spec": "speculative steps read before the next is queued (model.overlap_speculative off)",
    "temperature-only": "sampling requests with top-p off (the captured variant that skips sorting the vocabulary); "
    "other sampling rows use top-p 0.95",
    "no-pdl": "small-step Triton kernels launched without programmatic dependent launch (model.pdl off)",
    "adaptive": "adaptive speculation (speculative.adaptive): each step's depth in 0..K from the batch size, the "
    "step costs timed at start-up and the running acceptance per position",
    "chain-graphs": "draft chain captured on its own (UniformChainStep, as on a separate draft worker or Ray "
    "rank 0) instead of inside the fused speculative step",
}


def engine_for(
    args: argparse.Namespace, k: int, graphs: bool, max_batch: int, fused: bool = True, variant: str = ""
) -> LLMEngine:
    """A bf16 CUDA engine; k=0 is target-only; fused picks the Triton layer kernels; `variant` is one of
    VARIANTS."""
    small_rows = TritonOps.small_rows
    if variant == "no-gemv":
        TritonOps.small_rows = 0
    try:
        eng = _engine(
            args,
            k,
            graphs,
            max_batch,
            fused,
            variant != "no-overlap",
            variant != "no-overlap-spec",
            variant != "no-pdl",
            variant == "adaptive",
        )
    finally:
        TritonOps.small_rows = small_rows
    if variant == "chain-graphs":
        eng.target.fused = None  # type: ignore[attr-defined]
        build_chain_graphs(eng.cfg, eng.draft, eng.max_model_len)
    return eng


def _engine(
    args: argparse.Namespace,
    k: int,
    graphs: bool,
    max_batch: int,
    fused: bool,
    overlap: bool,
    overlap_spec: bool,
    pdl: bool,
    adaptive: bool = False,
) -> LLMEngine:
    cfg = MTPServeConfig.from_dict(
        {
            "model": {
                "path": args.model,
                "device": args.device,
                "dtype": args.dtype,
                "cuda_graphs": graphs,
                "overlap_steps": overlap,
                "overlap_speculative": overlap_spec,
                "fused_kernels": fused,
                "pdl": pdl,
                "max_model_len": args.max_model_len,
            },
            "scheduler": {
                "max_num_requests": max_batch,
                "max_num_batched_tokens": 4096,
                "chunk_size": 512,
                "prefix_caching": False,  # prompts repeat across rows: time prefill, not cache hits
                "num_kv_blocks": getattr(args, "num_kv_blocks", None),
            },
            "speculative": {
                "enabled": k > 0,
                "draft": args.head,
                "num_draft_tokens": max(k, 1),
                "adaptive": adaptive and k > 0,
            },
        }
    )
    return LLMEngine.from_config(cfg)


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_p: float = 0.95
) -> dict[str, Any]:
    """Prefill all prompts, then time the generation steps only (seeded sampling when temperature > 0)."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature, "top_p": top_p}
    ids = [engine.add_request(p, {**params, "seed": i}) for i, p in enumerate(prompts)]
    reqs = [engine.scheduler.requests[r] for r in ids]
    while any(r.in_context for r in reqs):
        engine.step()
    sync()
    policy = engine.scheduler.depth
    depths_before = list(policy.steps_per_depth) if policy is not None else []
    t0 = time.perf_counter()
    steps = tokens = 0
    emitted: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        for o in outs:
            tokens += len(o.new_token_ids)
            emitted[o.request_id].extend(o.new_token_ids)
    dt = time.perf_counter() - t0  # the last token is on the host: every step returns read tokens
    sync()  # with overlap, one more step (queued ahead, then dropped) may still be running
    dt_drained = time.perf_counter() - t0
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    verify = sum(r.stats.verify_steps for r in reqs)
    return {
        "batch": len(prompts),
        "tok_s": tokens / dt,
        "step_ms": 1e3 * dt / max(steps, 1),
        "step_ms_incl_drain": 1e3 * dt_drained / max(steps, 1),
        "steps": steps,
        "tokens": tokens,
        "acceptance_length": 1 + accepted / verify if verify else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "fused_replays": replays(getattr(engine.target, "fused", None)),
        "uniform_replays": replays(getattr(engine.target, "uniform", None)),
        "chain_replays": replays(getattr(engine.draft, "uniform", None)),
        "outputs": [emitted[r] for r in ids],
        "steps_per_depth": None
        if policy is None
        else [a - b for a, b in zip(policy.steps_per_depth, depths_before, strict=True)],
        "acceptance_rates": None if policy is None else [round(r, 4) for r in policy.tracker.rates()],
    }


def sampled_graphs(engine: LLMEngine) -> bool | None:
    """Whether every sampling variant of the captured step was captured (None without captured steps)."""
    step = getattr(engine.target, "fused", None) or getattr(engine.target, "uniform", None)
    if step is None:
        return None
    steps = step.by_depth[step.k].steps if hasattr(step, "by_depth") else step.steps
    return all(v.graphs for m, v in steps.variants.items() if m is not SamplingMode.GREEDY)


def replays(step: Any) -> int | None:
    """CUDA-graph replays of a captured step object, or None."""
    return None if step is None else int(step.replays if hasattr(step, "replays") else step.steps.replays)


def agreement(runs: list[dict[str, Any]]) -> None:
    """Mark each greedy run with the share of its requests whose tokens equal the target-only serving run
    at the same batch (greedy speculation is lossless up to bf16 rounding differences between shapes), then
    drop the raw token lists (they would make the report megabytes long)."""
    base = {
        r["batch"]: r["outputs"]
        for r in runs
        if r["k"] == 0 and not r["variant"] and r["graphs"] and r["fused"] and r["temperature"] == 0.0
    }
    for r in runs:
        ref = base.get(r["batch"])
        if r["temperature"] == 0.0 and ref is not None:
            same = sum(a == b for a, b in zip(r["outputs"], ref, strict=True))
            r["outputs_equal_target_only"] = same / len(ref)
    for r in runs:
        r.pop("outputs")


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the first generated token."""
    sync()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, {"max_tokens": 1, "ignore_eos": True})
    while True:
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            break
    sync()
    return time.perf_counter() - t0


def hf_peer(args: argparse.Namespace, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """HF transformers generate() on the same GGUF, bf16, batch 1 and batch 8 (left padded)."""
    from transformers import AutoModelForCausalLM

    p = Path(args.model)
    hf = (
        AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.bfloat16)
        .to(args.device)
        .eval()
    )
    hf.generation_config.eos_token_id = None
    out = []
    for batch in (1, 8):
        rows = prompts[:batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[2] * (width - len(r)) + r for r in rows], device=args.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=args.device)
        with torch.no_grad():
            hf.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=2)
            sync()
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
            sync()
        dt = time.perf_counter() - t0
        out.append({"batch": batch, "tok_s": batch * max_tokens / dt, "step_ms": 1e3 * dt / max_tokens})
    return out


def kernel_check() -> dict[str, Any]:
    """Triton paged attention in bf16 against a float64 reference."""
    from modeling.attention import AttentionMetadata, RaggedMetadata, uniform_paged_attention
    from modeling.triton_attention import triton_uniform_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for q_len in (1, 4):
        kc = torch.randn(300, 16, 3, 64, device="cuda", generator=g).bfloat16()
        vc = torch.randn(300, 16, 3, 64, device="cuda", generator=g).bfloat16()
        tables = torch.randperm(300, device="cuda", generator=g)[: 8 * 30].view(8, 30)
        lens = torch.randint(q_len, 30 * 16, (8,), device="cuda", generator=g)
        q = torch.randn(8 * q_len, 9, 64, device="cuda", generator=g).bfloat16()
        got = triton_uniform_attention(q, kc, vc, tables, lens, q_len, 0.125)
        ref = uniform_paged_attention(q.double(), kc.double(), vc.double(), tables, lens, q_len, 0.125)
        res[f"q{q_len}_max_abs_err"] = (got.double() - ref).abs().max().item()
    # ragged: a 512-row prefill chunk after 100 cached positions, a whole 300-token prompt, 3 decode rows
    starts, counts = [100, 0, 50, 7, 200], [512, 300, 1, 1, 1]
    tables = [list(range(i * 40, i * 40 + 40)) for i in range(len(starts))]
    kc = torch.randn(200, 16, 3, 64, device="cuda", generator=g).bfloat16()
    vc = torch.randn(200, 16, 3, 64, device="cuda", generator=g).bfloat16()
    q = torch.randn(sum(counts), 9, 64, device="cuda", generator=g).bfloat16()
    got = RaggedMetadata.build(starts, counts, tables, 16, "cuda").attend(q, kc, vc, 0.125)
    dense = AttentionMetadata.build(starts, counts, tables, 16, "cuda")
    ref = dense.attend(q.double(), kc.double(), vc.double(), 0.125)
    res["ragged_max_abs_err"] = (got.double() - ref).abs().max().item()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default=str(DEFAULT_HEAD) if DEFAULT_HEAD.is_file() else "random")
    ap.add_argument("--out", default="out")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--device", default="cuda", help="cpu for a quick dry run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--main-only", action="store_true", help="only the serving configuration (no ablations)")
    ap.add_argument(
        "--variants",
        help="with --main-only: the comma-separated variants to run beside the serving configuration "
        "(default: no-overlap,no-overlap-spec,no-pdl)",
    )
    ap.add_argument("--gemv-rows", type=int, default=TritonOps.small_rows, help="TritonOps.small_rows")
    ap.add_argument("--gemv-block-n", type=int, default=fused_kernels.GEMV_BLOCK_N, help="fused_kernels.GEMV_BLOCK_N")
    args = ap.parse_args()
    TritonOps.small_rows, fused_kernels.GEMV_BLOCK_N = args.gemv_rows, args.gemv_block_n
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "head": args.head,
        "gemv_rows": args.gemv_rows,
        "gemv_block_n": args.gemv_block_n,
        "max_tokens": args.max_tokens,
        "weight_floor_ms": WEIGHT_FLOOR_MS,
        "runs": [],
        "errors": [],
    }
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]

    def guarded(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
            print(f"[{time.perf_counter() - t0:6.1f}s] {name}: ok", flush=True)
            return result
        except Exception as exc:
            traceback.print_exc()
            report["errors"].append(f"{name}: {exc!r}")
            return None

    base = engine_for(args, 0, True, max(batches))
    prompts_all = [base.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(max(batches))]
    if torch.cuda.is_available():
        report["kernel_check"] = guarded("kernel check", kernel_check)
    # (graphs, fused kernels, k, batches): the full sweep, then the same engine without the fused kernels
    # and without graphs, to show what each buys.
    ends = [batches[0], batches[-1]]
    plan = [(True, True, k, batches, 0.0, "") for k in [0, *ks]]
    plan += [(True, True, k, ends, 0.7, v) for k in (0, 3) for v in ("", "temperature-only")]  # sampling requests
    plan += [(True, True, 0, batches, 0.0, "no-overlap")]
    plan += [(True, True, k, batches, 0.0, "no-overlap-spec") for k in (1, 3) if k in ks]
    plan += [(True, True, k, batches, 0.0, "no-pdl") for k in (0, 1, 3) if k in [0, *ks]]
    plan += [(True, True, max(ks), batches, 0.0, "adaptive")]
    plan += [(True, True, k, ends, 0.0, "no-gemv") for k in (0, 3)]
    plan += [(True, True, 3, ends, t, "chain-graphs") for t in (0.0, 0.7)]
    plan += [(True, False, k, ends, 0.0, "") for k in (0, 3)]
    plan += [(False, True, k, [batches[0]], 0.0, "") for k in (0, 3)]
    if args.main_only:  # greedy, graphs and fused kernels: with and without overlap and PDL
        keep = {"", *(args.variants or "no-overlap,no-overlap-spec,no-pdl").split(",")}
        plan = [p for p in plan if p[0] and p[1] and p[4] == 0.0 and p[5] in keep]
    for graphs, fused, k, bs, temp, variant in plan:
        label = f"k={k} graphs={graphs} fused={fused} {variant}".rstrip()
        eng = (
            base
            if (k == 0 and graphs and fused and temp == 0.0 and not variant)
            else guarded(
                f"engine {label}",
                lambda k=k, g=graphs, f=fused, v=variant: engine_for(args, k, g, max(batches), f, v),
            )
        )
        if eng is None:
            continue
        guarded("warmup", lambda e=eng: decode_run(e, prompts_all[:2], 8))
        if eng.scheduler.depth is not None:
            costs = eng.scheduler.depth.costs.seconds
            report.setdefault("adaptive_step_ms", {})[label] = {f"b{b}/d{d}": 1e3 * c for (b, d), c in costs.items()}
        for b in bs:
            r = guarded(
                f"decode {label} temperature={temp} batch={b}",
                lambda e=eng, b=b, t=temp, tp=1.0 if variant == "temperature-only" else 0.95: decode_run(
                    e, prompts_all[:b], args.max_tokens, t, tp
                ),
            )
            if r:
                r.update(k=k, graphs=graphs, fused=fused, temperature=temp, variant=variant)
                r["step_over_floor"] = r["step_ms"] / WEIGHT_FLOOR_MS
                r["sampled_graphs"] = sampled_graphs(eng)
                report["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
        if graphs and fused and temp == 0.0 and not variant:
            long_prompt = base.encode_prompt(" ".join(PROMPTS) * 6)[:520]
            t = guarded(f"ttft k={k}", lambda e=eng, lp=long_prompt: [ttft(e, lp) for _ in range(3)])
            if t:
                report.setdefault("ttft_ms", {})[f"k{k}"] = {
                    "prompt_tokens": len(long_prompt),
                    "ms": [1e3 * x for x in t],
                }
        if eng is not base:
            del eng
            torch.cuda.empty_cache()
        (out_dir / "h200_bench.json").write_text(json.dumps(report, indent=2))  # kept if a later part overruns
    agreement(report["runs"])
    report["variants"] = VARIANTS
    if not args.skip_hf:
        report["hf_generate"] = guarded("hf generate", lambda: hf_peer(args, prompts_all, args.max_tokens))
    (out_dir / "h200_bench.json").write_text(json.dumps(report, indent=2))
    guarded("plot", lambda: plot(report, out_dir / "h200_bench.png"))
    print_table(report)
    return 0


def print_table(report: dict[str, Any]) -> None:
    """Short summary table."""
    head = f"{'k':>2} {'graphs':>6} {'fused':>6} {'temp':>4} {'batch':>5} {'tok/s':>10} {'step ms':>8} {'/floor':>7}"
    print(f"\n{head} {'AL':>5} {'same':>5} variant")
    for r in report["runs"]:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        same = r.get("outputs_equal_target_only")
        print(
            f"{r['k']:>2} {r['graphs']!s:>6} {r.get('fused', True)!s:>6} {r.get('temperature', 0):>4} "
            f"{r['batch']:>5} {r['tok_s']:>10.1f} "
            f"{r['step_ms']:>8.3f} {r['step_ms'] / WEIGHT_FLOOR_MS:>7.1f} {al:>5} "
            f"{'-' if same is None else f'{same:.2f}':>5} {r.get('variant', '')}"
            + (f" depths {r['steps_per_depth']}" if r.get("steps_per_depth") else "")
        )
    for r in report.get("hf_generate") or []:
        print(f"HF generate batch {r['batch']}: {r['tok_s']:.1f} tok/s, {r['step_ms']:.2f} ms/step")
    print("ttft", json.dumps(report.get("ttft_ms")), "kernel", json.dumps(report.get("kernel_check")))
    print("errors", report["errors"])


def plot(report: dict[str, Any], path: Path) -> None:
    """tok/s against batch size for each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    main_runs = [
        r
        for r in report["runs"]
        if r["graphs"] and r.get("fused", True) and not r.get("temperature") and not r.get("variant")
    ]
    for k in sorted({r["k"] for r in main_runs}):
        rows = sorted((r["batch"], r["tok_s"]) for r in main_runs if r["k"] == k)
        ax.plot(*zip(*rows, strict=True), marker="o", label="target only" if k == 0 else f"MTP K={k}")
    hf = report.get("hf_generate") or []
    if hf:
        ax.plot([r["batch"] for r in hf], [r["tok_s"] for r in hf], "k--", marker="x", label="HF generate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tok/s")
    ax.set_title(f"SmolLM2-135M bf16 on {report['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
