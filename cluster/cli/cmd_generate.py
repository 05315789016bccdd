"""`mtpserve generate`: one prompt, in process (--local) or against a running server (--server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.cluster.engine.errors import MTPServeError

if TYPE_CHECKING:
    from mtpserve.cluster.service.client import MTPServeClient

TOKEN_ENV = "MTPSERVE_AUTH_TOKEN"


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    """Register the sub-command."""
    p = sub.add_parser(
        name,
        help="generate text for one prompt",
        description="Generate for one prompt, either with an in-process engine (--local) or through a running "
        "`mtpserve serve` (--server HOST:PORT). Speculates whenever a draft head is configured.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="load the model in this process")
    where.add_argument("--server", metavar="HOST:PORT", help="address of a running mtpserve gRPC server")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, finish_reason, stats")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds (--server)")
    g = p.add_argument_group("security (--server)")
    g.add_argument(
        "--auth-token-file", help="file with the server's bearer token (default: $MTPSERVE_AUTH_TOKEN if set)"
    )
    g.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CA roots")
    g.add_argument("--tls-ca", help="PEM CA bundle that signed the server's certificate (implies --tls)")
    g.add_argument("--tls-cert", help="PEM client certificate for mutual TLS (with --tls-key)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    add_engine_flags(p)
    p.set_defaults(func=run)


def sampling_dict(args: argparse.Namespace) -> dict:
    """SamplingParams fields from the flags."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def run(args: argparse.Namespace) -> int:
    """Generate and print."""
    if args.server:
        return run_remote(args)
    cfg = config_from_args(args)
    from mtpserve.cluster.distributed.build import build_engine
    from mtpserve.workers.builders import set_cpu_threads

    try:
        set_cpu_threads(cfg)
        engine = build_engine(cfg)
        ids = engine.encode_prompt(args.prompt, chat=not args.raw)
        t0 = time.perf_counter()
        (done,) = engine.generate([ids], sampling_dict(args))
        elapsed = time.perf_counter() - t0
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    finally:
        if "engine" in locals():
            engine.shutdown()
    if args.json:
        print(json.dumps(done.to_json()))
    else:
        print(done.text)
        s = done.stats
        line = f"[{len(done.token_ids)} tokens in {elapsed:.2f}s, finish={done.finish_reason}"
        if s.verify_steps:
            line += f", acceptance length {s.acceptance_length:.2f}, rate {s.acceptance_rate:.2f}"
        print(line + "]", file=sys.stderr)
    return 0


def client_for(args: argparse.Namespace) -> MTPServeClient:
    """The client that the --server and security flags describe; ConfigError/OSError for unusable files."""
    from mtpserve.cluster.service.auth import read_secret
    from mtpserve.cluster.service.client import MTPServeClient

    token = os.environ.get(TOKEN_ENV) or None
    if args.auth_token_file:
        token = read_secret(args.auth_token_file, "--auth-token-file").decode()
    return MTPServeClient(
        args.server,
        timeout=args.timeout,
        auth_token=token,
        tls=args.tls,
        tls_ca_file=args.tls_ca,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
    )


def run_remote(args: argparse.Namespace) -> int:
    """`mtpserve generate --server HOST:PORT`: stream text to stdout, or print one JSON object with --json."""
    import grpc

    sampling = sampling_dict(args)
    raw = bool(vars(args).get("raw", False))
    try:
        client = client_for(args)
    except (OSError, ValueError, MTPServeError) as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            if args.json:
                print(json.dumps(client.generate(args.prompt, raw=raw, **sampling)))
                return 0
            t0 = time.perf_counter()
            n, last = 0, None
            for chunk in client.stream(args.prompt, raw=raw, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                n += len(chunk.token_ids)
                last = chunk
            print()
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"mtpserve: {code.name if code else 'ERROR'}: {details}", file=sys.stderr)
        return 1
    line = f"[{n} tokens in {time.perf_counter() - t0:.2f}s, finish={last.finish_reason if last else None}"
    if last is not None and last.stats.get("verify_steps"):
        line += f", acceptance length {last.stats['acceptance_length']:.2f}, rate {last.stats['acceptance_rate']:.2f}"
    print(line + "]", file=sys.stderr)
    return 0
