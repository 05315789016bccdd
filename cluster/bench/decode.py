"""Decode speed in one process, the engine driven directly: the serving configuration and its ablations
(`VARIANTS`), per draft depth and batch size, with the share of greedy outputs equal to target-only.

`bench/gpu.py` runs the sweep on one GPU; `bench_ttft` and `bench_trees` reuse `decode_run` and `sync`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.layer_ops import TritonOps
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.sampling import SamplingMode
from mtpserve.workers.config import MTPServeConfig

WEIGHT_FLOOR_MS = 0.063  # SmolLM2-135M bf16: its weights read once at the H200's 4.8 TB/s

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
    "no-overlap": "target-only steps read their tokens before the next step is launched (model.overlap_steps off)",
    "no-overlap-spec": "speculative steps read before the next is launched (model.overlap_speculative off)",
    "temperature-only": "sampling requests with top-p off (the captured variant that skips sorting the vocabulary); "
    "other sampling rows use top-p 0.95",
    "no-pdl": "small-step Triton kernels launched without programmatic dependent launch (model.pdl off)",
    "adaptive": "adaptive speculation (speculative.adaptive): each step's depth in 0..K from the batch size, the "
    "step costs timed at start-up and the running acceptance per position",
    "chain-graphs": "draft chain captured on its own (UniformChainStep, as on a separate draft worker or Ray "
    "rank 0) instead of inside the fused speculative step",
}


def sync() -> None:
    """Wait for the GPU work launched so far (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def add_probe_flags(ap: argparse.ArgumentParser) -> None:
    """The flags `engine_for` reads: the benchmarks' target flags (on CUDA by default) and --gemv-tiles."""
    bench_report.add_target_flags(ap, "cuda", need_model=True)
    ap.add_argument(
        "--gemv-tiles",
        default="auto",
        help="model.gemv_tiles: auto (the table measured on this GPU model), default, or a table like 4=4x2r",
    )


def engine_for(
    args: argparse.Namespace,
    k: int,
    graphs: bool,
    max_batch: int,
    *,
    fused: bool = True,
    variant: str = "",
    gemv_tiles: str | None = None,
    tree: bool = False,
) -> LLMEngine:
    """An engine of `args` (model, load_format, draft, device, dtype, max_model_len, num_kv_blocks, tree_budget,
    tree_width); k=0 is target-only; fused picks the Triton layer kernels; `variant` is one of VARIANTS;
    `gemv_tiles` is `model.gemv_tiles` (default: args.gemv_tiles, else auto); `tree` drafts a tree of depth k
    (the adaptive variant offers it among the chain depths)."""
    small_rows, opts = TritonOps.small_rows, vars(args)  # options other callers' arguments may lack
    if variant == "no-gemv":
        TritonOps.small_rows = 0
    try:
        cfg = MTPServeConfig.from_dict(
            {
                "model": {
                    "path": args.model,
                    "load_format": opts.get("load_format", "auto"),
                    "device": args.device,
                    "dtype": args.dtype,
                    "cuda_graphs": graphs,
                    "overlap_steps": variant != "no-overlap",
                    "overlap_speculative": variant != "no-overlap-spec",
                    "fused_kernels": fused,
                    "fused_steps": variant != "chain-graphs",
                    "pdl": variant != "no-pdl",
                    "gemv_tiles": gemv_tiles or opts.get("gemv_tiles", "auto"),
                    "max_model_len": args.max_model_len,
                },
                "scheduler": {
                    "max_num_requests": max_batch,
                    "max_num_batched_tokens": 4096,
                    "chunk_size": 512,
                    "prefix_caching": False,  # prompts repeat across rows: time prefill, not cache hits
                    "num_kv_blocks": opts.get("num_kv_blocks", None),
                },
                "speculative": {
                    "enabled": k > 0,
                    "draft": args.draft,
                    "num_draft_tokens": max(k, 1),
                    "adaptive": variant == "adaptive" and k > 0,
                    # adaptive over a draft tree too, where the caller asks for one
                    "tree_budget": opts.get("tree_budget", 0) if (variant == "adaptive" or tree) and k > 0 else 0,
                    "tree_width": opts.get("tree_width", 4),
                },
            }
        )
        eng = LLMEngine.from_config(cfg)
    finally:
        TritonOps.small_rows = small_rows
    return eng


def bench_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """`n` prompts: the chat prompts of PROMPTS cycled, or token ids of a chat prompt's length without a
    tokenizer (dummy weights)."""
    if engine.tokenizer is None:
        span = min(1000, engine.args.vocab_size - 10)
        return [[(7 * i + 3 * j) % span + 10 for j in range(40)] for i in range(n)]
    return [engine.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_p: float = 0.95
) -> dict[str, Any]:
    """Prefill all prompts, then time the generation steps only (seeded sampling when temperature > 0).

    `full_tok_s` counts only the steps that run while every request is still going: the rate a server
    whose finished requests are replaced at once holds. The wave's own rate (`tok_s`) also counts its tail,
    where the requests that accept least run on in a shrinking batch."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature, "top_p": top_p}
    ids = [engine.add_request(p, {**params, "seed": i}) for i, p in enumerate(prompts)]
    reqs = [engine.scheduler.requests[r] for r in ids]
    while any(r.in_context for r in reqs):
        engine.step()
    sync()
    policy = engine.scheduler.depth
    depths_before = list(policy.steps_per_depth) if policy is not None else []
    trees_before = policy.tree_steps if policy is not None else 0
    t0 = time.perf_counter()
    steps = tokens = full_steps = full_tokens = 0
    full_s, full = 0.0, True
    emitted: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        t_step = time.perf_counter()
        outs = engine.step()
        steps += 1
        n = sum(len(o.new_token_ids) for o in outs)
        tokens += n
        if full:
            full_steps, full_tokens, full_s = full_steps + 1, full_tokens + n, full_s + time.perf_counter() - t_step
        for o in outs:
            emitted[o.request_id].extend(o.new_token_ids)
            full = full and not o.finished
    dt = time.perf_counter() - t0  # the last token is on the host: every step returns read tokens
    sync()  # with overlap, one more step (launched ahead, then dropped) may still be running
    dt_drained = time.perf_counter() - t0
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    verify = sum(r.stats.verify_steps for r in reqs)
    runner = bench_report.local_runner(engine)
    return {
        "batch": len(prompts),
        "tok_s": tokens / dt,
        "step_ms": 1e3 * dt / max(steps, 1),
        "step_ms_incl_drain": 1e3 * dt_drained / max(steps, 1),
        "steps": steps,
        "tokens": tokens,
        "full_tok_s": full_tokens / full_s if full_s else None,
        "full_s": full_s,
        "full_steps": full_steps,
        "full_tokens": full_tokens,
        "acceptance_length": 1 + accepted / verify if verify else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "fused_replays": replays(None if runner is None else runner.steps.chain),
        "uniform_replays": replays(None if runner is None else runner.steps.target),
        "chain_replays": replays(engine.draft.uniform if isinstance(engine.draft, MTPEagleChain) else None),
        "outputs": [emitted[r] for r in ids],
        "steps_per_depth": None
        if policy is None
        else [a - b for a, b in zip(policy.steps_per_depth, depths_before, strict=True)],
        "acceptance_rates": None if policy is None else [round(r, 4) for r in policy.tracker.rates()],
        "tree_steps": None if policy is None or not policy.trees else policy.tree_steps - trees_before,
    }


def sampled_graphs(engine: LLMEngine) -> bool | None:
    """Whether every sampling variant of the captured step was captured (None without captured steps)."""
    runner = bench_report.local_runner(engine)
    if runner is None:
        return None
    fused = runner.steps.chain
    steps = fused.depth_steps()[fused.k].steps if fused is not None else None
    if steps is None and runner.steps.target is not None:
        steps = runner.steps.target.steps
    if steps is None:
        return None
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


def sweep_plan(ks: list[int], batches: list[int], main_only: bool, variants: str | None) -> list[tuple]:
    """(graphs, fused, k, batches, temperature, variant) per engine: the serving configuration at every depth,
    then the ablations that show what each part buys; `main_only` keeps greedy runs of the serving
    configuration and of `variants` (default: no-overlap, no-overlap-spec, no-pdl)."""
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
    if main_only:
        keep = {"", *(variants or "no-overlap,no-overlap-spec,no-pdl").split(",")}
        plan = [p for p in plan if p[0] and p[1] and p[4] == 0.0 and p[5] in keep]
    return plan


def decode_table(runs: list[dict[str, Any]]) -> str:
    """One line per run: depth, graphs, fused, temperature, batch, tok/s, step ms, acceptance, equality."""
    lines = [
        f"{'k':>2} {'graphs':>6} {'fused':>6} {'temp':>4} {'batch':>5} {'tok/s':>10} {'step ms':>8} {'AL':>5} "
        f"{'same':>5} variant"
    ]
    for r in runs:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        same = r.get("outputs_equal_target_only")
        lines.append(
            f"{r['k']:>2} {r['graphs']!s:>6} {r['fused']!s:>6} {r['temperature']:>4} {r['batch']:>5} "
            f"{r['tok_s']:>10.1f} {r['step_ms']:>8.3f} {al:>5} {'-' if same is None else f'{same:.2f}':>5} "
            f"{r['variant']}" + (f" depths {r['steps_per_depth']}" if r.get("steps_per_depth") else "")
        )
    return "\n".join(lines)
