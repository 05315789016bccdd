"""`mtpserve bench load`: many concurrent gRPC streams against one `mtpserve serve` process: how each ends,
tokens, KV blocks and memory, over several rounds.

The server runs in a subprocess (so client threads do not compete with its engine loop); the client
opens --streams streams at once over a few channels with grpc.aio. Each stream is greedy or sampled
(temperature, or temperature + top-p), with a random prompt length and max_tokens, and a fate: run to
the end, cancel after the first chunk, or a deadline too short to finish. Per round it records how every
stream ended, wrong ends (a finished stream without its max_tokens tokens, or a status other than the
fate's), output tok/s, and after the round settles the server's KV blocks in use, running and waiting
requests and resident memory (the serving process and its engine process). After the first round every
greedy stream that finished is run again alone; the report gives the fraction with identical tokens (bf16
on a GPU can differ at near ties between batch shapes; fp32 on CPU must match exactly). Exit status 1 when
any stream ended wrongly or a KV block stayed held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from mtpserve import cluster
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.procs import tree_gpu_mb, tree_rss_mb
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc
from mtpserve.workers.config import MTPServeConfig

ROOT = Path(cluster.__file__).resolve().parent.parent  # the checkout the server subprocess imports from


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `bench load`."""
    p = bench_report.add_command(
        kinds, "load", "many concurrent gRPC streams against a `serve` subprocess: ends, KV blocks, memory", __doc__
    )
    p.add_argument("--model", help="GGUF file or HF Llama directory (default: the default model)")
    p.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], help="the server's")
    p.add_argument("--draft", help="draft head (default: the shipped one)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--dtype", default="auto", help="the server's dtype (float32 shows whether greedy mismatches are bf16)"
    )
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--channels", type=int, default=8, help="client channels the streams spread over")
    p.add_argument(
        "--lengths", type=bench_report.int_list, default=[16, 64, 256, 512], help="prompt lengths to pick from"
    )
    p.add_argument(
        "--max-tokens", type=bench_report.int_list, default=[8, 64], help="min,max of each stream's max_tokens"
    )
    p.add_argument("--deadline-ms", type=float, default=50.0, help="deadline of the 'deadline' streams")
    p.add_argument("--max-num-requests", type=int, default=256, help="the server's running slots")
    p.add_argument("--vocab", type=int, help="token ids are drawn below this (default: the served vocabulary)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="OUT", help="write the report (command, environment, settings, results)")
    p.add_argument("--plot", metavar="OUT.png", help="plot tok/s and server memory per round")
    p.set_defaults(func=main)


SERVING = re.compile(r"serving gRPC on (?P<host>\S+):(?P<port>\d+)")
ALLOWED = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED"}


@dataclass
class Spec:
    """One planned stream."""

    prompt: list[int]
    max_tokens: int
    mode: str  # greedy | temperature | top_p
    fate: str  # run | cancel | deadline
    seed: int


@dataclass
class Outcome:
    """How one stream ended."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    code: str | None = None


def plan(n: int, seed: int, vocab: int, lengths: list[int], max_tokens: tuple[int, int]) -> list[Spec]:
    """n streams: a third each greedy, temperature-only and top-p; fates run : cancel : deadline = 6 : 1 : 1."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.choice(lengths))]
        fate = rng.choices(["run", "cancel", "deadline"], weights=[6, 1, 1])[0]
        specs.append(Spec(prompt, rng.randint(*max_tokens), ("greedy", "temperature", "top_p")[i % 3], fate, seed=i))
    return specs


def request(spec: Spec) -> pb.GenerateRequest:
    """The GenerateRequest of a planned stream."""
    sampling = pb.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    if spec.mode != "greedy":
        sampling.temperature, sampling.seed = 0.8, spec.seed
        if spec.mode == "top_p":
            sampling.top_p = 0.9
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=spec.prompt), sampling=sampling)


async def run_stream(stub: Any, spec: Spec, deadline_s: float, go: asyncio.Event) -> Outcome:
    """One stream, started when `go` is set."""
    out = Outcome()
    await go.wait()
    call = stub.Generate(request(spec), timeout=deadline_s if spec.fate == "deadline" else 900.0)
    try:
        async for msg in call:
            out.tokens.extend(msg.token_ids)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                out.finish = pb.FinishReason.Name(msg.finish_reason)
            if spec.fate == "cancel":
                call.cancel()
                break
    except grpc.aio.AioRpcError as exc:
        out.code = exc.code().name
    except asyncio.CancelledError:
        out.code = "CANCELLED"
    if spec.fate == "cancel" and out.code is None and out.finish is None:
        out.code = "CANCELLED"
    return out


async def one_round(address: str, specs: list[Spec], channels: int, deadline_s: float) -> tuple[list[Outcome], float]:
    """All streams at once; (outcomes, seconds)."""
    chans = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)
    ]
    stubs = [pb_grpc.InferenceStub(c) for c in chans]
    go = asyncio.Event()
    tasks = [asyncio.create_task(run_stream(stubs[i % channels], s, deadline_s, go)) for i, s in enumerate(specs)]
    await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    go.set()
    outcomes = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t0
    for c in chans:
        await c.close()
    return list(outcomes), seconds


async def alone(address: str, specs: list[Spec]) -> list[list[int]]:
    """Each spec run by itself, one after another: its tokens."""
    async with grpc.aio.insecure_channel(address) as chan:
        stub = pb_grpc.InferenceStub(chan)
        out = []
        for s in specs:
            tokens: list[int] = []
            async for msg in stub.Generate(request(s), timeout=600.0):
                tokens.extend(msg.token_ids)
            out.append(tokens)
        return out


async def served_vocab(address: str) -> int:
    """The served model's vocabulary size."""
    async with grpc.aio.insecure_channel(address) as chan:
        return int((await pb_grpc.InferenceStub(chan).GetModelInfo(pb.GetModelInfoRequest(), timeout=30.0)).vocab_size)


async def stats(address: str) -> pb.GetStatsResponse:
    """The server's GetStats."""
    async with grpc.aio.insecure_channel(address) as chan:
        return await pb_grpc.InferenceStub(chan).GetStats(pb.GetStatsRequest(), timeout=30.0)


async def settle(address: str, timeout: float = 120.0) -> pb.GetStatsResponse:
    """Wait until nothing runs or waits and no KV block is held; the last stats either way."""
    end = time.monotonic() + timeout
    while True:
        s = await stats(address)
        if (s.requests_running == s.requests_waiting == s.kv_blocks_used == 0) or time.monotonic() > end:
            return s
        await asyncio.sleep(0.2)


def check(specs: list[Spec], outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts of how streams ended, and every wrong end."""
    ends: dict[str, int] = {}
    wrong = []
    for i, (s, o) in enumerate(zip(specs, outcomes, strict=True)):
        end = o.code or o.finish or "NO_FINAL_MESSAGE"
        ends[end] = ends.get(end, 0) + 1
        if o.code is None:
            if o.finish != "FINISH_REASON_LENGTH" or len(o.tokens) != s.max_tokens:
                wrong.append(
                    {"stream": i, "fate": s.fate, "finish": o.finish, "tokens": len(o.tokens), "want": s.max_tokens}
                )
        elif o.code != ALLOWED.get(s.fate):
            wrong.append({"stream": i, "fate": s.fate, "code": o.code})
    runs = [s for s in specs if s.fate == "run"]
    finished_runs = sum(1 for s, o in zip(specs, outcomes, strict=True) if s.fate == "run" and o.code is None)
    return {"ends": ends, "wrong": wrong, "run_streams": len(runs), "run_streams_finished": finished_runs}


def start_server(args: argparse.Namespace, config: Path) -> tuple[subprocess.Popen[str], str, list[str]]:
    """`python -m mtpserve serve` in a subprocess; its address once it serves."""
    cmd = [sys.executable, "-m", "mtpserve", "serve", "--config", str(config), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--metrics-port", "0", "--device", args.device, "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if args.draft:
        cmd += ["--draft", args.draft]
    proc, found, lines = bench_report.serve_subprocess(cmd, ROOT, SERVING, args.startup_timeout)
    return proc, f"{found['host']}:{found['port']}", lines


def server_config(args: argparse.Namespace) -> dict[str, Any]:
    """The served config: slots, queue and a KV cache that holds every running stream at its longest."""
    longest, hi, block = max(args.lengths), max(args.max_tokens), 16
    return {
        "model": {"max_model_len": longest + hi + 64},
        "scheduler": {
            "max_num_requests": args.max_num_requests,
            "max_queue": max(1024, 2 * args.streams),
            "block_size": block,
            "num_kv_blocks": args.max_num_requests * -(-(longest + hi + 16) // block) + 64,
        },
    }


def run_rounds(args: argparse.Namespace, proc: subprocess.Popen[str], address: str) -> tuple[list, dict]:
    """Every round against the running server: (rounds, the first round's greedy streams run alone)."""
    lo, hi = min(args.max_tokens), max(args.max_tokens)
    rounds: list[dict[str, Any]] = []
    equal: dict[str, Any] = {}
    vocab = args.vocab or asyncio.run(served_vocab(address))
    for r in range(args.rounds):
        specs = plan(args.streams, seed=r, vocab=vocab, lengths=args.lengths, max_tokens=(lo, hi))
        outcomes, seconds = asyncio.run(one_round(address, specs, args.channels, args.deadline_ms / 1e3))
        settled = asyncio.run(settle(address))
        row = {
            "round": r,
            "streams": len(specs),
            "seconds": seconds,
            "output_tokens": sum(len(o.tokens) for o in outcomes),
            **check(specs, outcomes),
            "after": {
                "kv_blocks_used": settled.kv_blocks_used,
                "kv_blocks_total": settled.kv_blocks_total,
                "requests_running": settled.requests_running,
                "requests_waiting": settled.requests_waiting,
                "server_rss_mb": tree_rss_mb(proc.pid),
                "server_gpu_mb": tree_gpu_mb(proc.pid),
            },
        }
        row["tok_per_s"] = row["output_tokens"] / seconds
        rounds.append(row)
        print(
            json.dumps({k: v for k, v in row.items() if k != "wrong"} | {"wrong": len(row["wrong"])}),
            file=sys.stderr,
            flush=True,
        )
        if r == 0:
            greedy = [(s, o) for s, o in zip(specs, outcomes, strict=True) if s.mode == "greedy" and o.code is None]
            again = asyncio.run(alone(address, [s for s, _ in greedy]))
            same = [a == o.tokens for a, (_, o) in zip(again, greedy, strict=True)]
            first_diff = [
                next(i for i, (x, y) in enumerate(zip(a, o.tokens, strict=False)) if x != y)
                for a, (_, o) in zip(again, greedy, strict=True)
                if a != o.tokens and len(a) == len(o.tokens)
            ]
            equal = {"greedy_streams": len(greedy), "identical": sum(same), "first_divergence": first_diff}
    return rounds, equal


def table(rounds: list[dict[str, Any]]) -> str:
    """One line per round."""
    body = [
        [
            str(row["round"]),
            str(row["streams"]),
            f"{row['seconds']:.1f}",
            f"{row['tok_per_s']:.0f}",
            str(len(row["wrong"])),
            str(row["after"]["kv_blocks_used"]),
            f"{row['after']['server_rss_mb']:.0f}",
            str(row["ends"]),
        ]
        for row in rounds
    ]
    return bench_report.table(["round", "streams", "s", "tok/s", "wrong", "kv used", "rss MB", "ends"], body)


def main(args: argparse.Namespace) -> int:
    """`mtpserve bench load`: 0 when every stream ended as its fate asked and no KV block stayed held."""
    if len(args.max_tokens) != 2:
        print("mtpserve: --max-tokens takes two values, min,max", file=sys.stderr)
        return 2
    config = server_config(args)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    try:
        proc, address, log = start_server(args, Path(f.name))
    except bench_report.BenchError as exc:
        os.unlink(f.name)
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    try:
        rounds, equal = run_rounds(args, proc, address)
    finally:
        bench_report.stop_subprocess(proc)
        os.unlink(f.name)
    cfg = MTPServeConfig.from_dict({"model": {"device": args.device, "dtype": args.dtype}})
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "json", "plot", "command", "bench")}
    doc = bench_report.report(
        "load",
        bench_report.command_of(args),
        cfg=cfg,
        settings=settings,
        results=rounds,
        server_config=config,
        greedy_alone=equal,
        server_log_tail=log[-20:],
    )
    print(doc["command"])
    print(table(rounds))
    if equal:
        print(f"greedy streams equal to the same request alone: {equal['identical']}/{equal['greedy_streams']}")
    if args.json:
        bench_report.write_json(args.json, doc)
    if args.plot:
        series = {
            "output tok/s": [(r["round"], r["tok_per_s"]) for r in rounds],
            "server RSS MB": [(r["round"], r["after"]["server_rss_mb"]) for r in rounds],
        }
        bench_report.plot_lines(args.plot, series, f"{args.streams} concurrent streams", "round", ylabel="value")
    return 0 if all(not row["wrong"] and row["after"]["kv_blocks_used"] == 0 for row in rounds) else 1
