"""`mtpserve bench serve`: what `mtpserve serve` hands its clients against what its engine computes alone.

For each config (target-only and the default speculative config) and each stream count, in one run:
- engine alone: the engine in a process of its own, driven by a closed loop of the same requests (each finished
  request replaced at once, so prefill counts as it does when served): output tok/s over a measured window;
- served: `mtpserve serve` (loopback, every port chosen by the system, `--frontends` as given) driven by client
  processes in a closed loop over HTTP (the official `openai` client, streamed completions) and over gRPC
  (grpc.aio Generate streams), each front end in turn: output tok/s received in the window, TTFT of requests sent
  in it, inter-token latency (a chunk's gap over its tokens), client CPU, and the server's CPU per 1k tokens per
  process (its supervisor, engine and front ends, Linux).
Random token-id prompts (--prompt-len), --output-len tokens each, greedy, `ignore_eos`. A warm-up before each
window is not counted. Rows carry `ratio` = served / engine alone. --tiny serves a tiny random Llama on the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from mtpserve import cluster
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.http_vs_grpc import SERVING, TINY_CONFIG
from mtpserve.cluster.bench.loop_clients import LoopClients, LoopResult
from mtpserve.cluster.bench.procs import cpu_s, process_tree, read_stat
from mtpserve.workers.config import MTPServeConfig

ROOT = Path(cluster.__file__).resolve().parent.parent  # the checkout the server subprocess imports from
CONFIGS = ("target-only", "speculative")
PROMPT_VOCAB = 32000  # prompt token ids are drawn below this: inside any Llama-family vocabulary
PROMPT_VOCAB_TINY = cast(int, TINY_CONFIG["vocab_size"])
SETTINGS = (
    "tiny", "model", "draft", "configs", "streams", "frontends", "prompt_len", "output_len", "warmup_s", "window_s",
    "client_procs", "device", "dtype", "serve_args", "seed",
)  # fmt: skip


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench serve`."""
    p = bench_report.add_command(
        kinds, "serve", "served tok/s (openai and gRPC clients) against the engine alone, same closed loop", __doc__
    )
    p.add_argument("--model", help="GGUF file or HF Llama directory (default: the default model)")
    p.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], help="the model's")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama (dummy weights, random draft)")
    p.add_argument("--draft", help="draft head (default: the shipped one)")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, of target-only and speculative (default: both)"
    )
    p.add_argument("--streams", type=bench_report.int_list, default=[1, 64, 256], help="concurrent streams (1,64,256)")
    p.add_argument("--frontends", type=bench_report.int_list, default=[1], help="serve --frontends values to run")
    p.add_argument("--front-ends", default="http,grpc", help="which APIs to drive (default http,grpc)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=4.0, help="seconds before each window, not counted")
    p.add_argument("--window-s", type=float, default=10.0, help="measured seconds per row")
    p.add_argument("--client-procs", type=int, default=4, help="client processes the streams spread over")
    p.add_argument("--no-engine-alone", action="store_true", help="skip the engine-alone rows")
    p.add_argument("--serve-args", default="", help="more `mtpserve serve` flags, space-separated")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report (command, environment, settings, results)")
    p.add_argument("--plot", metavar="OUT.png", help="bars of engine-alone and served tok/s per row")
    p.set_defaults(func=main, threads=None)


def engine_config(args: argparse.Namespace, config: str, model: str | None) -> dict[str, Any]:
    """The config both sides run: a slot and KV blocks for every stream at its longest."""
    block, length, most = 16, args.prompt_len + args.output_len + 64, max(args.streams)
    cfg: dict[str, Any] = {
        "model": {"max_model_len": length, "device": args.device, "dtype": args.dtype},
        "speculative": {"enabled": config == "speculative"},
        "scheduler": {
            "max_num_requests": most,
            "max_queue": 4 * most,
            "block_size": block,
            "num_kv_blocks": most * -(-length // block) + 64,
            "prefix_caching": False,
        },
    }
    if model:
        cfg["model"]["path"] = model
    if args.tiny:
        cfg["model"]["load_format"] = "dummy"
        cfg["speculative"]["draft"] = "random"
    elif args.load_format:
        cfg["model"]["load_format"] = args.load_format
    if args.draft:
        cfg["speculative"]["draft"] = args.draft
    return cfg


def prompts_for(args: argparse.Namespace, vocab: int, n: int = 2048) -> list[list[int]]:
    """Random token-id prompts, fresh for every request (no prefix-cache hits)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(n)]


def engine_alone(cfg: dict[str, Any], args: dict[str, Any], streams: int) -> dict[str, Any]:
    """In a process of its own: the engine in a closed loop of `streams` requests; output tok/s in the window."""
    from mtpserve.cluster.engine.llm_engine import LLMEngine
    from mtpserve.cluster.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(MTPServeConfig.from_dict(cfg))
    try:
        prompts = iter(prompts_for(argparse.Namespace(**args), args["vocab"], 20_000))
        params = SamplingParams(max_tokens=args["output_len"], ignore_eos=True)
        live: dict[str, float] = {}  # request id: when it was added, until its first token
        seq = 0
        start = time.perf_counter()
        measure_from, end = start + args["warmup_s"], start + args["warmup_s"] + args["window_s"]
        tokens = 0
        ttft_ms: list[float] = []
        before = engine_counters(engine)
        while (now := time.perf_counter()) < end:
            while len(live) < streams:
                rid = f"r{seq}"
                seq += 1
                engine.add_request(next(prompts), params, rid)
                live[rid] = time.perf_counter()
            for o in engine.step():
                if now >= measure_from:
                    tokens += len(o.new_token_ids)
                added = live.get(o.request_id, 0.0)
                if added > 0 and o.new_token_ids:
                    if added >= measure_from:
                        ttft_ms.append(1e3 * (time.perf_counter() - added))
                    live[o.request_id] = 0.0
                if o.finished:
                    live.pop(o.request_id, None)
            if now < measure_from:
                before = engine_counters(engine)
        figures = {"engine_tok_s": tokens / args["window_s"], "engine_ttft_p50_ms": pct(ttft_ms, 0.5)}
        return figures | step_shares(before, engine_counters(engine))
    finally:
        engine.shutdown()


def run_engine_alone(cfg: dict[str, Any], args: argparse.Namespace, streams: int, vocab: int) -> dict[str, Any]:
    """`engine_alone` in a spawned process, so that its device memory is gone when it returns."""
    ctx = multiprocessing.get_context("spawn")
    plain = bench_report.settings_of(args, ("prompt_len", "output_len", "warmup_s", "window_s", "seed"))
    with ctx.Pool(1) as pool:
        return pool.apply(engine_alone, (cfg, plain | {"vocab": vocab}, streams))


def server_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of each process of the served tree."""
    stats = {p: read_stat(p) for p in process_tree(pid)}
    return {p: cpu_s(st[1]) for p, st in stats.items() if st is not None}


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


STEP_COUNTERS = {
    "steps": "mtpserve_engine_steps_total",
    "launched": "mtpserve_engine_steps_launched_total",
    "rows": "mtpserve_engine_step_rows_total",
}


def step_counters(metrics_port: str) -> dict[str, float]:
    """The engine's step counters from the server's /metrics (zeros where one is missing)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in page.splitlines() if line and not line.startswith("#"))
    return {key: float(values.get(name, 0.0)) for key, name in STEP_COUNTERS.items()}


@dataclass
class WindowReadings:
    """The served tree's CPU seconds and step counters, each time it is called (as a window opens and closes)."""

    pid: int
    metrics_port: str
    taken: list[tuple[dict[int, float], dict[str, float]]] = field(default_factory=list)

    def __call__(self) -> None:
        self.taken.append((server_cpu(self.pid), step_counters(self.metrics_port)))


def engine_counters(engine: Any) -> dict[str, float]:
    """An in-process engine's step counters, as `step_counters` reads them from /metrics."""
    return {"steps": engine.steps_run, "launched": engine.steps_launched, "rows": engine.rows_run}


def step_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Steps between two readings of the step counters, the share of them launched ahead and rows per step."""
    steps = after["steps"] - before["steps"]
    return {
        "engine_steps": steps,
        "launched_share": (after["launched"] - before["launched"]) / steps if steps else None,
        "rows_per_step": (after["rows"] - before["rows"]) / steps if steps else None,
    }


def served_row(
    r: LoopResult, args: argparse.Namespace, cpu0: dict[int, float], cpu1: dict[int, float]
) -> dict[str, Any]:
    """One served measurement as a report row."""
    tok_s = r.tokens / args.window_s
    k_tokens = max(r.tokens, 1) / 1000
    per_proc = {str(p): round((cpu1[p] - cpu0.get(p, 0.0)) / k_tokens, 4) for p in cpu1}
    return {
        "served_tok_s": tok_s,
        "ttft_p50_ms": pct(r.ttft_ms, 0.5),
        "ttft_p99_ms": pct(r.ttft_ms, 0.99),
        "itl_p50_ms": pct(r.itl_ms, 0.5),
        "itl_p99_ms": pct(r.itl_ms, 0.99),
        "life_p50_ms": pct(r.life_ms, 0.5),
        "tail_p50_ms": pct(r.tail_ms, 0.5),
        "tokens_per_chunk": r.tokens / r.chunks if r.chunks else None,
        "requests_finished": r.requests,
        "client_cpu_s_per_1k_tokens": r.cpu_s / k_tokens,
        "client_cpu_util": r.cpu_s / args.window_s,
        "server_cpu_s_per_1k_tokens_per_process": per_proc,
        "errors": len(r.errors),
        "first_errors": r.errors[:3],
    }


def serve_command(args: argparse.Namespace, config: Path, frontends: int) -> list[str]:
    """`python -m mtpserve serve` on loopback, every port chosen by the system, HTTP on."""
    cmd = [sys.executable, "-m", "mtpserve", "serve", "--config", str(config), "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--http-port", "0", "--metrics-port", "0", "--frontends", str(frontends)]
    return cmd + (args.serve_args.split() if args.serve_args else [])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every config, stream count, front-end count and API; the report."""
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise bench_report.BenchError(f"--configs: unknown {sorted(unknown)} (choose from {', '.join(CONFIGS)})")
    apis = [a for a in args.front_ends.split(",") if a]
    rows: list[dict[str, Any]] = []
    alone_by_run: dict[str, Any] = {}  # engine-alone figures by "config streams", for a report cut short
    clients = LoopClients(args.client_procs)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
            model = args.model
            if args.tiny:
                (Path(tmp) / "tiny").mkdir()
                (Path(tmp) / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
                model = str(Path(tmp) / "tiny")
            for config in configs:
                cfg = engine_config(args, config, model)
                (Path(tmp) / "serve.yaml").write_text(yaml.safe_dump(cfg))
                vocab = PROMPT_VOCAB_TINY if args.tiny else PROMPT_VOCAB
                engine = {}
                if not args.no_engine_alone:
                    for streams in args.streams:
                        engine[streams] = run_engine_alone(cfg, args, streams, vocab)
                        alone_by_run[f"{config} {streams}"] = engine[streams]
                        print(f"{config} engine alone, {streams} streams: {engine[streams]}", file=sys.stderr)
                        save_so_far(args, rows, model, alone_by_run)
                prompts = prompts_for(args, vocab)
                for frontends in args.frontends if apis else []:  # no API to drive: the engine alone only
                    cmd = serve_command(args, Path(tmp) / "serve.yaml", frontends)
                    proc, found, _log = bench_report.serve_subprocess(cmd, ROOT, SERVING, args.startup_timeout)
                    try:
                        for streams in args.streams:
                            for api in apis:
                                print(
                                    f"measuring: {config}, {api}, {streams} streams, serve pid {proc.pid}",
                                    file=sys.stderr,
                                )
                                readings = WindowReadings(proc.pid, found["metrics"])
                                r = clients.run(
                                    api,
                                    found[api],
                                    streams=streams,
                                    prompts=prompts,
                                    output_len=args.output_len,
                                    warmup_s=args.warmup_s,
                                    window_s=args.window_s,
                                    at_window=readings,
                                )
                                row = {"config": config, "frontends": frontends, "front_end": api, "streams": streams}
                                (cpu0, steps0), (cpu1, steps1) = readings.taken
                                row |= served_row(r, args, cpu0, cpu1)
                                row |= step_shares(steps0, steps1)
                                by_alone = engine.get(streams, {})
                                alone = by_alone.get("engine_tok_s")
                                row["engine_tok_s"] = alone
                                row["ratio"] = row["served_tok_s"] / alone if alone else None
                                row["engine_life_ms"] = 1e3 * streams * args.output_len / alone if alone else None
                                row["engine_ttft_p50_ms"] = by_alone.get("engine_ttft_p50_ms")
                                rows.append(row)
                                print(short(row), file=sys.stderr, flush=True)
                                save_so_far(args, rows, model, alone_by_run)
                    finally:
                        bench_report.stop_subprocess(proc)
    finally:
        clients.close()
    return serve_report(args, rows, model, engine_alone=alone_by_run)


def serve_report(
    args: argparse.Namespace, rows: list[dict[str, Any]], model: str | None, **sections: Any
) -> dict[str, Any]:
    """The report of `rows` (with any further `sections`)."""
    return bench_report.report(
        "serve",
        bench_report.command_of(args),
        cfg=MTPServeConfig.from_dict({"model": {"device": args.device, "dtype": args.dtype}}),
        settings=bench_report.settings_of(args, SETTINGS),
        results=rows,
        model=model if not args.tiny else {"tiny": TINY_CONFIG},
        **sections,
    )


def save_so_far(args: argparse.Namespace, rows: list[dict[str, Any]], model: str | None, alone: dict[str, Any]) -> None:
    """The report of what has finished, written to --json marked incomplete (the finished report replaces it), so
    that a run cut short by a time limit keeps its figures."""
    if args.json:
        bench_report.write_json(args.json, serve_report(args, rows, model, complete=False, engine_alone=alone))


def short(row: dict[str, Any]) -> str:
    """A row in one line."""
    ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
    ttft, ttft99 = row["ttft_p50_ms"] or 0.0, row["ttft_p99_ms"] or 0.0
    launched = row.get("launched_share")
    return (
        f"{row['config']:>11} fe={row['frontends']} {row['front_end']:>4} {row['streams']:>4} streams: "
        f"{row['served_tok_s']:9.0f} tok/s served, engine {row['engine_tok_s'] or 0:9.0f}, ratio {ratio}, "
        f"TTFT p50/p99 {ttft:.1f}/{ttft99:.1f} ms, launched {'-' if launched is None else f'{launched:.2f}'}, "
        f"request life p50 {ms(row.get('life_p50_ms'))} ms (tail {ms(row.get('tail_p50_ms'))}; engine alone "
        f"{ms(row.get('engine_life_ms'))}, its TTFT {ms(row.get('engine_ttft_p50_ms'))}), errors {row['errors']}"
    )


def ms(value: float | None) -> str:
    """Milliseconds to one decimal, or "-"."""
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row."""
    head = ["config", "frontends", "API", "streams", "engine tok/s", "served tok/s", "ratio", "TTFT p50/p99 ms"]
    head += ["ITL p50/p99 ms", "client CPU", "errors"]
    body = []
    for r in rows:
        f = [r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"]]
        t = [f"{x:.1f}" if x is not None else "-" for x in f]
        body.append(
            [
                r["config"],
                str(r["frontends"]),
                r["front_end"],
                str(r["streams"]),
                f"{r['engine_tok_s']:.0f}" if r["engine_tok_s"] else "-",
                f"{r['served_tok_s']:.0f}",
                f"{r['ratio']:.2f}" if r["ratio"] else "-",
                f"{t[0]} / {t[1]}",
                f"{t[2]} / {t[3]}",
                f"{r['client_cpu_util']:.2f}",
                str(r["errors"]),
            ]
        )
    return bench_report.table(head, body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Bars of engine-alone and served tok/s per row."""
    bars = {
        f"{r['config']} fe{r['frontends']} {r['front_end']} {r['streams']}": {
            "engine alone": r["engine_tok_s"] or 0.0,
            "served": r["served_tok_s"],
        }
        for r in rows
    }
    bench_report.plot_bars(path, bars, title, "output tok/s")


def failed(doc: dict[str, Any]) -> int:
    """1 when any stream failed."""
    return 1 if any(r["errors"] for r in doc["results"]) else 0


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench serve`."""
    return bench_report.run_measurement(
        args, run, table, plot, title="served against the engine alone", exit_status=failed
    )
