"""The one-GPU benchmark set in one process: one JSON and one PNG per group, all in the report format of
`mtpserve bench` (benchmark, command, environment, settings, results).

Groups (`--groups`, default all):
  decode   SmolLM2: target-only and MTP K per --ks at each batch size, the ablation variants, TTFT of a
           520-token prompt, an attention check against float64 and HF `generate` as a peer
  ttft     time to first token by prompt length, alone and with 63 requests decoding (`mtpserve bench ttft`)
  trees    draft trees against chains (`mtpserve bench trees`)
  llama8b  the same at Llama-3-8B's shape with random weights and a random head: step cost only
  replay   per-step acceptance recorded on the real SmolLM2 + head (held-apart sets), replayed at Llama-3-8B's
           shape with random weights: tok/s and speed-up with realistic acceptance (`mtpserve bench replay`)
  prefix   multi-turn chats over a shared 2,000-token document, cached and uncached (`bench prefix-cache`)
  load     1,024 concurrent gRPC streams against a `serve` subprocess (`mtpserve bench load`)
  distributed  the Ray path (one target worker, draft colocated) against in-process: step time and the per-hop
           timeline (`mtpserve bench distributed`; needs Ray)

    python3 bench/gpu.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpserve.cluster.bench import decode as bench_decode
from mtpserve.cluster.bench import distributed as bench_distributed
from mtpserve.cluster.bench import replay as bench_replay
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench import trees as bench_trees
from mtpserve.cluster.bench import ttft as bench_ttft
from mtpserve.cluster.bench.report import depth_list, int_list
from mtpserve.cluster.cli.mtpserve import main as mtpserve
from mtpserve.cluster.distributed.build import build_engine
from mtpserve.workers.builders import DEFAULT_HEAD

GROUPS = ("decode", "ttft", "trees", "llama8b", "replay", "prefix", "load", "distributed")
LLAMA_8B = {  # Llama-3-8B's config.json shape fields; weights are random (--load-format dummy)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TREE_CONFIGS = "target-only,chain K=1,chain K=3,tree K=3 N=8 w=3,tree K=4 N=16 w=4,tree K=6 N=32 w=4"
LLAMA_8B_CONFIGS = "target-only,chain K=1,chain K=3,tree K=3 N=8 w=3,tree K=5 N=24 w=4"
REPLAY_CONFIGS = "target-only,chain K=1,chain K=3,tree K=4 N=16 w=4"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags: the target and draft, the output folder, the groups and each group's sizes."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the SmolLM2 GGUF or an HF Llama directory (default: the packaged SmolLM2)")
    ap.add_argument("--load-format", default="auto", help="'dummy' for random weights of --model's config.json")
    ap.add_argument("--draft", default=str(DEFAULT_HEAD), help="draft head (default: the shipped one)")
    ap.add_argument("--out", default="out", help="folder for gpu_<group>.json and gpu_<group>.png")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run on a tiny model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (decode, trees)")
    ap.add_argument("--ks", type=int_list, default=[1, 2, 3], help="decode: draft depths beside target-only")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 64], help="decode: batch sizes")
    ap.add_argument("--all-variants", action="store_true", help="decode: every ablation of bench_decode.VARIANTS")
    ap.add_argument("--variants", default="no-overlap,no-overlap-spec,no-pdl,adaptive", help="decode: which, else")
    ap.add_argument("--skip-hf", action="store_true", help="decode: no HF generate peer")
    ap.add_argument("--ttft-lengths", type=int_list, default=[128, 512, 2048, 8160])
    ap.add_argument("--ttft-ks", type=depth_list, default=[0, 3])
    ap.add_argument("--ttft-busy", type=int, default=63)
    ap.add_argument("--tree-configs", default=TREE_CONFIGS)
    ap.add_argument("--tree-batches", type=int_list, default=[1, 8])
    ap.add_argument("--llama8b-configs", default=LLAMA_8B_CONFIGS)
    ap.add_argument("--llama8b-batches", type=int_list, default=[1, 8])
    ap.add_argument("--replay-configs", default=REPLAY_CONFIGS)
    ap.add_argument("--replay-batches", type=int_list, default=[1, 8, 64])
    ap.add_argument("--replay-requests", type=int, default=4, help="replay: requests per batch size at least")
    ap.add_argument("--replay-shape", default="llama8b", help="replay: 'llama8b', or a config.json folder (dry runs)")
    ap.add_argument("--replay-num-prompts", type=int, default=None, help="replay: record the first N of each set")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--load-streams", type=int, default=1024)
    ap.add_argument("--load-rounds", type=int, default=3)
    ap.add_argument("--load-lengths", default="16,64,256,512", help="load: prompt lengths to pick from")
    ap.add_argument("--distributed-setups", type=bench_distributed.setup_list, default=["in-process", "ray-tp1"])
    ap.add_argument("--distributed-batches", type=int_list, default=[1, 16])
    ap.add_argument("--distributed-ks", type=depth_list, default=[0, 3])
    ap.add_argument("--distributed-steps", type=int, default=48, help="distributed: timed decode steps per row")
    ap.add_argument("--distributed-repeats", type=int, default=2)
    args = ap.parse_args(argv)
    unknown = set(args.groups.split(",")) - set(GROUPS)
    if unknown:
        ap.error(f"--groups: unknown {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return args


def attention_check() -> dict[str, Any]:
    """Triton paged attention in bf16 against a float64 reference (max abs error), uniform and ragged."""
    from mtpserve.modeling.attention import AttentionMetadata, RaggedMetadata, uniform_paged_attention
    from mtpserve.modeling.triton_attention import triton_uniform_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for q_len in (1, 4):
        kc = torch.randn(300, 16, 3, 64, device="cuda", generator=g).bfloat16()
        vc = torch.randn(300, 16, 3, 64, device="cuda", generator=g).bfloat16()
        tables = torch.randperm(300, device="cuda", generator=g)[: 8 * 30].view(8, 30)
        lens = torch.randint(q_len, 30 * 16, (8,), device="cuda", generator=g)
        q = torch.randn(8 * q_len, 9, 64, device="cuda", generator=g).bfloat16()
        got = triton_uniform_attention(q, kc, vc, tables, seq_lens=lens, q_len=q_len, scale=0.125)
        ref = uniform_paged_attention(
            q.double(), kc.double(), vc.double(), tables, seq_lens=lens, q_len=q_len, scale=0.125
        )
        res[f"q{q_len}_max_abs_err"] = (got.double() - ref).abs().max().item()
    # ragged: a 512-row prefill chunk after 100 cached positions, a whole 300-token prompt, 3 decode rows
    starts, counts = [100, 0, 50, 7, 200], [512, 300, 1, 1, 1]
    tables_r = [list(range(i * 40, i * 40 + 40)) for i in range(len(starts))]
    kc = torch.randn(200, 16, 3, 64, device="cuda", generator=g).bfloat16()
    vc = torch.randn(200, 16, 3, 64, device="cuda", generator=g).bfloat16()
    q = torch.randn(sum(counts), 9, 64, device="cuda", generator=g).bfloat16()
    got = RaggedMetadata.build(starts, counts, tables_r, block_size=16, device="cuda").attend(q, kc, vc, 0.125)
    dense = AttentionMetadata.build(starts, counts, tables_r, block_size=16, device="cuda")
    ref = dense.attend(q.double(), kc.double(), vc.double(), 0.125)
    res["ragged_max_abs_err"] = (got.double() - ref).abs().max().item()
    return res


def decode_group(args: argparse.Namespace, errors: list[str], path: Path) -> dict[str, Any]:
    """The serving configuration and its ablations per depth and batch size; TTFT; checks; the HF peer. The
    report so far is written to `path` after each engine, so a run stopped early keeps what it measured."""
    batches = args.batches
    base = bench_decode.engine_for(args, 0, True, max(batches))
    prompts = bench_decode.bench_prompts(base, max(batches))
    extra: dict[str, Any] = {
        "weight_floor_ms": bench_decode.WEIGHT_FLOOR_MS,
        "variants": bench_decode.VARIANTS,
        "errors": errors,
    }
    settings = {
        "ks": args.ks,
        "batches": batches,
        "max_tokens": args.max_tokens,
        "all_variants": args.all_variants,
        "variants": args.variants,
        "max_model_len": args.max_model_len,
    }
    doc = bench_report.report(
        "gpu decode", command(), cfg=base.cfg, settings=settings, results=[], model=args.model, draft=args.draft
    )
    if torch.cuda.is_available() and args.device == "cuda":
        extra["attention_check"] = guarded(errors, "attention check", attention_check)
    runs: list[dict[str, Any]] = []
    plan = bench_decode.sweep_plan(args.ks, batches, not args.all_variants, args.variants)
    for graphs, fused, k, bs, temp, variant in plan:
        label = f"k={k} graphs={graphs} fused={fused} {variant}".rstrip()
        serving = k == 0 and graphs and fused and temp == 0.0 and not variant
        eng = (
            base
            if serving
            else guarded(
                errors,
                f"engine {label}",
                lambda k=k, g=graphs, f=fused, v=variant: bench_decode.engine_for(
                    args, k, g, max(batches), fused=f, variant=v
                ),
            )
        )
        if eng is None:
            continue
        guarded(errors, "warm-up", lambda e=eng: bench_decode.decode_run(e, prompts[:2], 8))
        if eng.scheduler.depth is not None:
            costs = eng.scheduler.depth.costs.seconds
            extra.setdefault("adaptive_step_ms", {})[label] = {f"b{b}/d{d}": 1e3 * c for (b, d), c in costs.items()}
        top_p = 1.0 if variant == "temperature-only" else 0.95
        for b in bs:
            r = guarded(
                errors,
                f"decode {label} temperature={temp} batch={b}",
                lambda e=eng, b=b, t=temp, tp=top_p: bench_decode.decode_run(
                    e, prompts[:b], args.max_tokens, t, top_p=tp
                ),
            )
            if r:
                r.update(k=k, graphs=graphs, fused=fused, temperature=temp, variant=variant)
                r["step_over_floor"] = r["step_ms"] / bench_decode.WEIGHT_FLOOR_MS
                r["sampled_graphs"] = bench_decode.sampled_graphs(eng)
                runs.append(r)
                print(json.dumps(without_outputs(r)), flush=True)
        if graphs and fused and temp == 0.0 and not variant and base.tokenizer is not None:
            long_prompt = base.encode_prompt(" ".join(bench_decode.PROMPTS) * 6)[:520]
            t = guarded(errors, f"ttft k={k}", lambda e=eng, p=long_prompt: [bench_decode.ttft(e, p) for _ in range(3)])
            if t:
                extra.setdefault("ttft_ms", {})[f"k{k}"] = {
                    "prompt_tokens": len(long_prompt),
                    "ms": [1e3 * x for x in t],
                }
        if eng is not base:
            eng.shutdown()
            del eng
            empty_cache()
        bench_report.write_json(path, {**doc, **extra, "results": [without_outputs(r) for r in runs]})
    bench_decode.agreement(runs)
    if not args.skip_hf and args.model and args.model.endswith(".gguf"):
        extra["hf_generate"] = guarded(
            errors, "hf generate", lambda: bench_decode.hf_peer(args, prompts, args.max_tokens)
        )
    return {**doc, **extra, "results": runs}


def without_outputs(run: dict[str, Any]) -> dict[str, Any]:
    """A decode run without its token lists."""
    return {k: v for k, v in run.items() if k != "outputs"}


def plot_decode(doc: dict[str, Any], path: Path) -> None:
    """tok/s against batch size for the serving configuration at each depth (and HF generate)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in doc["results"]:
        if r["graphs"] and r["fused"] and not r["temperature"] and not r["variant"]:
            series.setdefault("target only" if r["k"] == 0 else f"MTP K={r['k']}", []).append((r["batch"], r["tok_s"]))
    series["HF generate"] = [(r["batch"], r["tok_s"]) for r in doc.get("hf_generate") or []]
    bench_report.plot_lines(
        path, series, f"decode, {doc['device_name']}", "batch size", ylabel="generated tok/s", log_x=True
    )


def sub_args(args: argparse.Namespace, **values: Any) -> argparse.Namespace:
    """A namespace for a `mtpserve bench` module: the shared target flags plus `values`."""
    shared = {k: getattr(args, k) for k in ("model", "load_format", "draft", "device", "dtype", "max_model_len")}
    return argparse.Namespace(**{**shared, "threads": None, "json": None, "plot": None, **values})


def run_group(name: str, args: argparse.Namespace, out: Path, errors: list[str]) -> None:
    """Run one group; write its JSON and PNG under `out`."""
    js, png = out / f"gpu_{name}.json", out / f"gpu_{name}.png"
    if name == "distributed":
        distributed_group(args, js, png, errors)
    elif name == "decode":
        doc = decode_group(args, errors, js)
        bench_report.write_json(js, doc)
        print(bench_decode.decode_table(doc["results"]), flush=True)
        guarded(errors, "plot decode", lambda: plot_decode(doc, png))
    elif name == "ttft":
        a = sub_args(
            args,
            lengths=args.ttft_lengths,
            ks=args.ttft_ks,
            busy=args.ttft_busy,
            busy_tokens=1024,
            repeats=3,
            chunk_size=512,
            max_batched_tokens=512,
            temperature=0.0,
            compare_eager_prefill=False,
        )
        doc = bench_ttft.run(a)
        doc["benchmark"], doc["command"] = "gpu ttft", command()
        bench_report.write_json(js, doc)
        print(bench_ttft.table(doc["results"]), flush=True)
        bench_ttft.plot(doc["results"], str(png), f"TTFT, {doc['device_name']}")
    elif name == "replay":
        replay_group(args, js, png)
    elif name in ("trees", "llama8b"):
        with tempfile.TemporaryDirectory() as shape_dir:
            if name == "llama8b":
                (Path(shape_dir) / "config.json").write_text(json.dumps(LLAMA_8B))
                a = sub_args(
                    args,
                    model=shape_dir,
                    load_format="dummy",
                    draft="random",
                    configs=args.llama8b_configs.split(","),
                    batches=args.llama8b_batches,
                    max_tokens=64,
                    num_prompts=8,
                )
            else:
                a = sub_args(
                    args,
                    configs=args.tree_configs.split(","),
                    batches=args.tree_batches,
                    max_tokens=args.max_tokens,
                    num_prompts=8,
                )
            doc = bench_trees.run(a)
        doc["benchmark"], doc["command"] = f"gpu {name}", command()
        bench_report.write_json(js, doc)
        print(bench_trees.table(doc["results"]), flush=True)
        bench_trees.plot(doc["results"], str(png), f"{name}, {doc['device_name']}")
    else:
        flags = ["--device", args.device, "--json", str(js), "--plot", str(png)]
        flags += [f for k in ("model", "draft") if getattr(args, k) for f in (f"--{k}", getattr(args, k))]
        if name == "prefix":
            flags += ["--prefix-len", str(args.prefix_len), "--conversations", "8", "--max-tokens", "64", "--quiet"]
            code = mtpserve(["bench", "prefix-cache", *flags])
        else:
            flags += [
                "--streams",
                str(args.load_streams),
                "--rounds",
                str(args.load_rounds),
                "--load-format",
                args.load_format,
                "--lengths",
                args.load_lengths,
            ]
            code = mtpserve(["bench", "load", *flags])
        if code:
            errors.append(f"{name}: exit status {code}")


def distributed_group(args: argparse.Namespace, js: Path, png: Path, errors: list[str]) -> None:
    """The Ray path against in-process (`mtpserve bench distributed`): SmolLM2 and its head, or with
    --load-format dummy the shape of --model's config.json and a random head."""
    dummy = args.load_format == "dummy"
    a = sub_args(
        args,
        shape=args.model if dummy else "smollm2",
        model=None if dummy else args.model,
        setups=args.distributed_setups,
        batches=args.distributed_batches,
        ks=args.distributed_ks,
        steps=args.distributed_steps,
        repeats=args.distributed_repeats,
        enforce_eager=False,
        build_engine=build_engine,
    )
    doc = bench_distributed.run(a)
    doc["benchmark"], doc["command"] = "gpu distributed", command()
    errors += [f"distributed {e['setup']} K={e['k']}: {e['error']}" for e in doc["errors"]]
    bench_report.write_json(js, doc)
    print(bench_distributed.table(doc["results"]), flush=True)
    bench_distributed.plot(doc["results"], str(png), f"Ray path against in-process, {doc['device_name']}")


def replay_group(args: argparse.Namespace, js: Path, png: Path) -> None:
    """Record the replay configurations on --model (greedy, the held-apart sets) and replay them at
    --replay-shape in this process; the recording lands beside the report."""
    with tempfile.TemporaryDirectory() as shape_dir:
        shape = args.replay_shape
        if shape == "llama8b":
            (Path(shape_dir) / "config.json").write_text(json.dumps(LLAMA_8B))
            shape = shape_dir
        a = sub_args(
            args,
            model=shape,
            load_format="dummy",
            draft="random",
            json=str(js),
            acceptance=str(js.with_name("gpu_replay_recording.json")),
            configs=bench_trees.config_list(args.replay_configs),
            batches=args.replay_batches,
            max_tokens=args.max_tokens,
            num_requests=args.replay_requests,
            sets=None,
            record=True,
            record_model=args.model,
            record_load_format=args.load_format,
            record_draft=args.draft,
            record_device=args.device,
            prompts=None,
            record_num_prompts=args.replay_num_prompts,
            record_batch=64,
        )
        doc = bench_replay.run(a)
    doc["benchmark"], doc["command"] = "gpu replay", command()
    bench_report.write_json(js, doc)
    print(doc["banner"], flush=True)
    print(bench_replay.table(doc["results"]), flush=True)
    bench_replay.plot(doc["results"], str(png), f"replayed acceptance, {doc['device_name']}")


def guarded(errors: list[str], name: str, fn: Any) -> Any:
    """fn(), or None with the error recorded: one failing part leaves the rest of the run standing."""
    t0 = time.perf_counter()
    try:
        result = fn()
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}: ok", flush=True)
        return result
    except Exception as exc:
        traceback.print_exc()
        errors.append(f"{name}: {exc!r}")
        return None


def empty_cache() -> None:
    """Give freed GPU memory back between engines."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def command() -> str:
    """This run's command line."""
    return " ".join(["python3 bench/gpu.py", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """Run the groups in order; 1 if any part failed (the others still ran and wrote their files)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for name in args.groups.split(","):
        guarded(errors, f"group {name}", lambda n=name: run_group(n, args, out, errors))
        empty_cache()
    print("errors:", errors or "none")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
