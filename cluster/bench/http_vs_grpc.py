"""`mtpserve bench http-vs-grpc`: the OpenAI-compatible HTTP API against gRPC on the same server: time to
first token and output tok/s at each batch size.

It starts one `mtpserve serve --http-port 0` subprocess (so the client does not compete with the engine loop
for the interpreter) and, per batch size, runs rounds of `batch` concurrent streaming requests over each front
end in turn (gRPC, HTTP, HTTP, gRPC, ...; one warm-up round of each first): random token-id prompts of
--prompt-len tokens, greedy, `ignore_eos`, --output-len tokens each, fresh prompts every round (no
prefix-cache hits). The gRPC client is grpc.aio over --channels channels; the HTTP client is aiohttp,
streaming `POST /v1/completions` as server-sent events with `return_token_ids`, one connection per stream.
TTFT runs from a request's send to its first chunk that carries a token; tok/s is a round's output tokens
over its wall time (first send to last end). The clients run in this process, or split over --client-procs
processes, since one Python client process can cap either front end at large batches. Also reported: tokens
per streamed chunk (the server merges the tokens a slow stream has not sent yet into one chunk) and the server's
CPU time per output token (its engine process included; Linux). --tiny serves a tiny random Llama (2 layers,
hidden 128, random draft), a CPU smoke run. Exit status 1 when a stream failed or came back short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtpserve import cluster
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.load import served_vocab, settle
from mtpserve.cluster.bench.procs import tree_cpu_s
from mtpserve.cluster.bench.stream_clients import Clients
from mtpserve.workers.config import MTPServeConfig

ROOT = Path(cluster.__file__).resolve().parent.parent  # the checkout the server subprocess imports from
SERVING = re.compile(r"serving gRPC on (?P<grpc>\S+), metrics on :(?P<metrics>\d+), HTTP on (?P<http>\S+)")
FRONT_ENDS = ("grpc", "http")
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SETTINGS = (
    "tiny", "draft", "no_speculation", "dtype", "batch_sizes", "repeats", "prompt_len", "output_len", "channels",
    "serve_args", "seed", "client_procs",
)  # fmt: skip


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench http-vs-grpc`."""
    p = bench_report.add_command(
        kinds, "http-vs-grpc", "the OpenAI HTTP API against gRPC on one `serve` subprocess: TTFT and tok/s", __doc__
    )
    p.add_argument("--model", help="GGUF file or HF Llama directory (default: the default model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama (dummy weights, random draft)")
    p.add_argument("--draft", help="draft head (default: the shipped one)")
    p.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", type=bench_report.int_list, default=[1, 64], help="streams per round (1,64)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per batch size and front end")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--channels", type=int, default=8, help="gRPC client channels the streams spread over")
    p.add_argument(
        "--client-procs", type=int, default=1, help="client processes the streams spread over (1: this process)"
    )
    p.add_argument("--serve-args", default="", help="more `mtpserve serve` flags, space-separated")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for http_vs_grpc.json (the same as --json OUT/http_vs_grpc.json)")
    p.add_argument("--json", metavar="OUT", help="write the report (command, environment, settings, results)")
    p.add_argument("--plot", metavar="OUT.png", help="plot output tok/s per front end and batch size")
    p.set_defaults(func=main, threads=None)


@dataclass
class Round:
    """One round of `batch` concurrent streams over one front end."""

    front_end: str
    batch: int
    warmup: bool
    seconds: float
    tokens: int
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    chunks: int = 0
    server_cpu_s: float | None = None

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.tokens / self.seconds if self.seconds else 0.0


def one_round(
    clients: Clients, front_end: str, addresses: dict[str, str], prompts: list[list[int]], args: argparse.Namespace
) -> Round:
    """All prompts at once over one front end; the server's CPU seconds (with its engine process) over the round."""
    cpu0 = tree_cpu_s(args.server_pid)
    streams = clients.run(front_end, addresses, prompts, output_len=args.output_len, channels=args.channels)
    cpu1 = tree_cpu_s(args.server_pid)
    seconds = max(s.end for s in streams) - min(s.sent for s in streams)
    r = Round(front_end, len(prompts), False, seconds, tokens=sum(s.tokens for s in streams))
    r.chunks = sum(s.chunks for s in streams)
    r.server_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    for s in streams:
        if s.error or s.tokens != args.output_len or s.first is None:
            r.errors.append(s.error or f"{s.tokens} tokens")
            continue
        r.ttft_ms.append(1e3 * (s.first - s.sent))
        if s.tokens > 1:
            r.tpot_ms.append(1e3 * (s.end - s.first) / (s.tokens - 1))
    return r


def server_config(args: argparse.Namespace) -> dict[str, Any]:
    """The served config: a slot and KV blocks for every stream of the largest batch at its longest."""
    block, length, most = 16, args.prompt_len + args.output_len + 64, max(args.batch_sizes)
    return {
        "model": {"max_model_len": length},
        "scheduler": {
            "max_num_requests": most,
            "max_queue": 4 * most,
            "block_size": block,
            "num_kv_blocks": most * -(-length // block) + 64,
            "prefix_caching": False,
        },
    }


def serve_command(args: argparse.Namespace, config: Path, model: str | None) -> list[str]:
    """`python -m mtpserve serve` on loopback, every port chosen by the system, HTTP on."""
    cmd = [sys.executable, "-m", "mtpserve", "serve", "--config", str(config), "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--http-port", "0", "--metrics-port", "0", "--device", args.device, "--dtype", args.dtype]
    if model:
        cmd += ["--model", model]
    if args.tiny:
        cmd += ["--load-format", "dummy", "--draft", "random"]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.no_speculation:
        cmd += ["--no-speculation"]
    return cmd + (args.serve_args.split() if args.serve_args else [])


def run_rounds(args: argparse.Namespace, addresses: dict[str, str]) -> list[Round]:
    """Every batch size: a warm-up round of each front end, then --repeats rounds of each, alternating."""
    clients = Clients(args.client_procs)
    try:
        return _rounds(clients, args, addresses)
    finally:
        clients.close()


def _rounds(clients: Clients, args: argparse.Namespace, addresses: dict[str, str]) -> list[Round]:
    rng = random.Random(args.seed)
    rounds: list[Round] = []
    vocab = asyncio.run(served_vocab(addresses["grpc"]))
    for batch in args.batch_sizes:
        for i in range(args.repeats + 1):
            for fe in FRONT_ENDS if i % 2 == 0 else FRONT_ENDS[::-1]:
                prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
                r = one_round(clients, fe, addresses, prompts=prompts, args=args)
                r.warmup = i == 0
                rounds.append(r)
                asyncio.run(settle(addresses["grpc"]))
                ttft = statistics.fmean(r.ttft_ms) if r.ttft_ms else float("nan")
                tag = " (warm-up)" if r.warmup else ""
                cpu = f", server CPU {r.server_cpu_s:.2f} s" if r.server_cpu_s is not None else ""
                line = f"batch {batch:>3} {fe:>4}: {r.tok_per_s:9.1f} tok/s, TTFT {ttft:8.1f} ms{cpu}"
                print(f"{line}, {len(r.errors)} errors{tag}", file=sys.stderr, flush=True)
    return rounds


def summarize(rounds: list[Round]) -> list[dict[str, Any]]:
    """Per batch size and front end: tok/s (median over rounds), TTFT and TPOT (over every request); and HTTP
    over gRPC."""
    out = []
    for batch in sorted({r.batch for r in rounds}):
        row: dict[str, Any] = {"batch": batch}
        for fe in FRONT_ENDS:
            rs = [r for r in rounds if r.batch == batch and r.front_end == fe and not r.warmup]
            ttft = sorted(t for r in rs for t in r.ttft_ms)
            tpot = [t for r in rs for t in r.tpot_ms]
            row[fe] = {
                "rounds": len(rs),
                "tok_per_s": statistics.median(r.tok_per_s for r in rs) if rs else None,
                "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
                "ttft_ms_p50": ttft[len(ttft) // 2] if ttft else None,
                "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
                "tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
                "tokens_per_chunk": sum(r.tokens for r in rs) / max(1, sum(r.chunks for r in rs)) if rs else None,
                "server_cpu_us_per_token": _cpu_per_token(rs),
                "errors": sum(len(r.errors) for r in rs),
            }
        g, h = row["grpc"], row["http"]
        if g["tok_per_s"] and h["tok_per_s"] and g["ttft_ms_mean"] and h["ttft_ms_mean"]:
            row["http_over_grpc"] = {
                "tok_per_s": h["tok_per_s"] / g["tok_per_s"],
                "ttft_ms_mean": h["ttft_ms_mean"] / g["ttft_ms_mean"],
            }
        out.append(row)
    return out


def _cpu_per_token(rounds: list[Round]) -> float | None:
    cpu = [r.server_cpu_s for r in rounds]
    if not rounds or any(c is None for c in cpu):
        return None
    return 1e6 * sum(c for c in cpu if c is not None) / max(1, sum(r.tokens for r in rounds))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run every round, stop it: the report (`results` per batch size, `rounds` each)."""
    config = server_config(args)
    with tempfile.TemporaryDirectory(prefix="http-vs-grpc-") as tmp:
        (Path(tmp) / "serve.yaml").write_text(yaml.safe_dump(config))
        model = args.model
        if args.tiny:
            (Path(tmp) / "tiny").mkdir()
            (Path(tmp) / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
            model = str(Path(tmp) / "tiny")
        cmd = serve_command(args, Path(tmp) / "serve.yaml", model)
        proc, addresses, log = bench_report.serve_subprocess(cmd, ROOT, SERVING, args.startup_timeout)
        args.server_pid = proc.pid
        try:
            rounds = run_rounds(args, addresses)
        finally:
            bench_report.stop_subprocess(proc)
    return bench_report.report(
        "http_vs_grpc",
        bench_report.command_of(args),
        cfg=MTPServeConfig.from_dict({"model": {"device": args.device, "dtype": args.dtype}}),
        settings=bench_report.settings_of(args, SETTINGS),
        results=summarize(rounds),
        model=model if not args.tiny else {"tiny": TINY_CONFIG},
        server_config=config,
        rounds=[asdict(r) | {"tok_per_s": r.tok_per_s} for r in rounds],
        server_log_tail=log[-20:],
    )


def table(rows: list[dict[str, Any]]) -> str:
    """tok/s, TTFT (mean, p50, p90), TPOT, tokens per chunk, server CPU per token and errors per batch size and
    front end."""
    body = []
    for row in rows:
        for fe in FRONT_ENDS:
            f = row[fe]
            if f["tok_per_s"] is None or f["ttft_ms_mean"] is None:
                body.append([str(row["batch"]), fe, "no complete round", *[""] * 6, str(f["errors"])])
                continue
            cells = [f["tok_per_s"], f["ttft_ms_mean"], f["ttft_ms_p50"], f["ttft_ms_p90"], f["tpot_ms_mean"] or 0]
            cells += [f["tokens_per_chunk"] or 0, f["server_cpu_us_per_token"] or 0]
            body.append([str(row["batch"]), fe, *(f"{x:.1f}" for x in cells), str(f["errors"])])
    head = ["batch", "front end", "tok/s", "TTFT mean ms", "p50", "p90", "TPOT ms", "tok/chunk", "server CPU us/tok"]
    head.append("errors")
    return bench_report.table(head, body)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Bars of output tok/s per batch size, one per front end."""
    bars = {f"batch {row['batch']}": {fe: row[fe]["tok_per_s"] or 0.0 for fe in FRONT_ENDS} for row in rows}
    bench_report.plot_bars(path, bars, title, "output tok/s (median round)")


def failed(doc: dict[str, Any]) -> int:
    """1 when a stream failed or came back short, else 0."""
    return 1 if any(r["errors"] for r in doc["rounds"]) else 0


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench http-vs-grpc`."""
    if args.out and not args.json:
        args.json = str(Path(args.out) / "http_vs_grpc.json")
    return bench_report.run_measurement(args, run, table, plot, title="HTTP against gRPC", exit_status=failed)
