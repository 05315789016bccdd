"""`mtpserve bench`: `throughput` (tok/s and step time per batch size), `acceptance` (draft acceptance),
`prefix-cache` (multi-turn chats with and without prefix caching), `ttft` (time to first token by prompt
length), `trees` (draft trees against chains, any Llama shape), `replay` (speculative speed at any Llama shape
with acceptance replayed from a real model's recording), `load` (concurrent streams against a server),
`distributed` (the Ray path against in-process), `http-vs-grpc` (the HTTP API against gRPC on one server) and
`serve` (served tok/s against the engine alone).

The flags of the first three live here; each other benchmark module registers its own sub-command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtpserve.cluster.bench import acceptance as bench_acceptance
from mtpserve.cluster.bench import distributed as bench_distributed
from mtpserve.cluster.bench import http_vs_grpc as bench_http_vs_grpc
from mtpserve.cluster.bench import load as bench_load
from mtpserve.cluster.bench import prefix as bench_prefix
from mtpserve.cluster.bench import replay as bench_replay
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench import serve as bench_serve
from mtpserve.cluster.bench import throughput as bench_throughput
from mtpserve.cluster.bench import trees as bench_trees
from mtpserve.cluster.bench import ttft as bench_ttft
from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.cluster.cli.config_flags import overrides_from
from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    """Register every `bench` sub-command."""
    p = sub.add_parser(
        name,
        help="measure throughput, acceptance, prefix caching, TTFT, trees, replayed acceptance, load, the "
        "distributed path",
        description="Benchmarks; every one writes the same report (command, environment, settings, results).",
    )
    kinds = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    t = kinds.add_parser(
        "throughput",
        help="decode tok/s, step time, prefill time and TTFT at several batch sizes",
        description="For each batch size, run that many random-token requests at once (greedy, ignore_eos) and "
        "report decode tok/s, mean decode step time, prefill time and TTFT. Target-only with --no-speculation; "
        "speculative when a draft head is configured. Works with --load-format dummy --model DIR for any Llama "
        "shape (DIR needs only a config.json).",
    )
    t.add_argument(
        "--batch-sizes", type=bench_report.int_list, default=[1, 8, 64], help="comma-separated (default 1,8,64)"
    )
    t.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    t.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    t.add_argument("--warmup-steps", type=int, default=3, help="engine steps of one throw-away request first")
    t.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    t.add_argument("--json", metavar="OUT", help="write the results, command and environment as JSON")
    t.add_argument("--plot", metavar="OUT.png", help="plot decode tok/s and step time against batch size")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_flags(t)
    t.set_defaults(func=run_throughput)

    a = kinds.add_parser(
        "acceptance",
        help="draft acceptance on a JSONL prompt file (greedy)",
        description="Greedy-decode each prompt (one at a time) with the draft head and report accepted/drafted, "
        "acceptance rate, acceptance length and per-position rates. The prompt field is the first of 'prompt', "
        "'turns' (first turn), 'question', 'text'. --compare runs TensorRT-LLM PR #18295's three settings on the "
        "same prompts: sampled lookahead with chunk C (before), prompt lookahead with chunk C (after), and no "
        "chunking.",
    )
    a.add_argument(
        "--prompts",
        required=True,
        action="append",
        metavar="FILE.jsonl",
        help="one JSON object per line; repeat for several sets (reported per file as well as in total). A "
        'record with "format": "raw" is sent without the chat template',
    )
    a.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default all)")
    a.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt (default 128)")
    a.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    a.add_argument("--no-chat-template", action="store_true", help="send the prompt text as is")
    a.add_argument("--compare", action="store_true", help="run sampled/prompt lookahead at --chunk-size, and unchunked")
    a.add_argument("--json", metavar="OUT", help="write the results, command and environment as JSON")
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    a.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_flags(a)
    a.set_defaults(func=run_acceptance)

    c = kinds.add_parser(
        "prefix-cache",
        help="multi-turn chats over a shared document, with and without prefix caching",
        description=(bench_prefix.__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--document",
        action="append",
        type=Path,
        metavar="FILE",
        help="text of the shared document; repeat to join files (default: the checkout's README.md and "
        "docs/architecture.md)",
    )
    c.add_argument("--prefix-len", type=int, default=2000, help="document tokens in the system prompt (default 2000)")
    c.add_argument("--conversations", type=int, default=8, help="conversations, at least 2 (default 8)")
    c.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    c.add_argument("--json", metavar="OUT", help="write the results, command and environment as JSON")
    c.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    c.add_argument("--plot", metavar="OUT.png", help="plot TTFT and tok/s with and without the cache")
    c.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_flags(c)
    c.set_defaults(func=run_prefix_cache)

    for module in (bench_ttft, bench_trees, bench_replay, bench_load, bench_http_vs_grpc, bench_serve):
        module.add_parser(kinds)
    bench_distributed.add_parser(kinds, build_engine)
    kinds.choices["distributed"].set_defaults(func=run_distributed)


def run_distributed(args: argparse.Namespace) -> int:
    """`mtpserve bench distributed`; a Ray runtime it starts in this process is shut down at the end, so a
    caller that runs it in process (tests, notebooks) can start its own afterwards."""
    started_here = not ray_running()
    try:
        return bench_distributed.main(args)
    finally:
        if started_here and ray_running():
            import ray

            ray.shutdown()


def ray_running() -> bool:
    """Whether this process has a Ray runtime up (without importing Ray)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def build_engine(cfg: MTPServeConfig) -> LLMEngine:
    """An engine of `cfg`, through Ray actors where it asks for them (Ray is imported only then)."""
    from mtpserve.cluster.distributed.build import build_engine as build

    return build(cfg)


def run_throughput(args: argparse.Namespace) -> int:
    """`mtpserve bench throughput`."""
    from mtpserve.cluster.distributed.build import build_engine

    _set_threads(args.threads)
    given = overrides_from(args)
    cfg = bench_throughput.throughput_config(
        config_from_args(args),
        args.batch_sizes,
        args.prompt_len,
        args.output_len,
        size_slots="scheduler.max_num_requests" not in given,
        size_cache="scheduler.num_kv_blocks" not in given,
    )
    command = bench_report.command_of(args)
    try:
        engine = build_engine(cfg)
        try:
            rows = bench_throughput.run_throughput(
                engine,
                args.batch_sizes,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                warmup_steps=args.warmup_steps,
                seed=args.seed,
                log=_err,
            )
            report = bench_throughput.throughput_report(
                cfg,
                engine,
                rows,
                {
                    "batch_sizes": args.batch_sizes,
                    "prompt_len": args.prompt_len,
                    "output_len": args.output_len,
                    "warmup_steps": args.warmup_steps,
                    "seed": args.seed,
                },
                command=command,
            )
        finally:
            engine.shutdown()
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    spec = report["speculation"]
    mode = f"speculative (K={spec['num_draft_tokens']}, draft {spec['draft']})" if spec["enabled"] else "target only"
    print(f"{command}\n{report['device']} ({report['device_name']}), {report['dtype']}, {mode}")
    print(bench_throughput.format_throughput_table(rows))
    if args.json:
        bench_report.write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        bench_throughput.plot_throughput(rows, args.plot, f"{report['model']['path']} - {report['device']} - {mode}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def run_acceptance(args: argparse.Namespace) -> int:
    """`mtpserve bench acceptance`."""
    from mtpserve.cluster.distributed.build import build_engine
    from mtpserve.modeling.loader import resolve_model

    if overrides_from(args).get("speculative.enabled") is False:
        print("mtpserve: bench acceptance measures the draft head; drop --no-speculation", file=sys.stderr)
        return 2
    _set_threads(args.threads)
    cfg = config_from_args(args)
    command = bench_report.command_of(args)
    try:
        records = {path: bench_acceptance.load_prompt_records(path, args.num_prompts) for path in args.prompts}
        source = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir)
        if source.dummy:
            raise bench_report.BenchError("acceptance needs real weights and a tokenizer, not --load-format dummy")
        tok = source.tokenizer()
        prompts, groups = [], []
        for path, recs in records.items():
            for text, chat in recs:
                prompts += bench_acceptance.encode_texts(tok, [text], chat=chat and not args.no_chat_template)
                groups.append(Path(path).stem)
        if args.compare:
            if "speculative.lookahead_source" in overrides_from(args):
                print("mtpserve: --compare runs both lookahead sources; --lookahead-source is ignored", file=sys.stderr)
            settings = bench_acceptance.compare_settings(cfg.scheduler.chunk_size)
        else:
            settings = [
                bench_acceptance.AcceptanceSetting(
                    "run", cfg.speculative.lookahead_source, cfg.scheduler.chunk_size, "as flagged"
                )
            ]
        results = bench_acceptance.run_acceptance_settings(
            build_engine,
            cfg,
            settings,
            prompts,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            progress=not args.quiet,
            groups=groups,
        )
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    print(command)
    print(
        f"{len(prompts)} prompts from {', '.join(args.prompts)}, max_tokens {args.max_tokens}, greedy, "
        f"draft {cfg.speculative.draft}"
    )
    print(bench_acceptance.format_acceptance_table(results))
    if len(records) > 1:
        print(bench_acceptance.format_group_table(results))
    if args.json:
        settings_json = {
            "prompts": args.prompts if len(args.prompts) > 1 else args.prompts[0],
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "chat_template": not args.no_chat_template,
            "compare": args.compare,
        }
        report = bench_acceptance.acceptance_report(cfg, source.args(), results, settings_json, command=command)
        bench_report.write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def run_prefix_cache(args: argparse.Namespace) -> int:
    """`mtpserve bench prefix-cache`."""
    from mtpserve.cluster.distributed.build import build_engine
    from mtpserve.modeling.loader import resolve_model

    _set_threads(args.threads)
    cfg = config_from_args(args)
    if "scheduler.prefix_caching" in overrides_from(args):
        print(
            "mtpserve: bench prefix-cache runs with and without caching; --prefix-caching is ignored", file=sys.stderr
        )
    command = bench_report.command_of(args)
    try:
        source = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir)
        if source.dummy:
            raise bench_report.BenchError(
                "prefix-cache needs a tokenizer and its chat template, not --load-format dummy"
            )
        tok = source.tokenizer()
        docs = args.document or list(bench_prefix.DEFAULT_DOCUMENTS)
        document, warmup = bench_prefix.load_documents(docs, tok, args.prefix_len)
        progress = (lambda line: None) if args.quiet else _err
        result = bench_prefix.run_prefix_bench(
            build_engine,
            cfg,
            tok,
            document,
            warmup_document=warmup,
            num_conversations=args.conversations,
            max_tokens=args.max_tokens,
            progress=progress,
        )
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    print(command)
    print(bench_prefix.format_prefix_table(result))
    if args.json:
        settings = {
            "documents": [str(d) for d in docs],
            "prefix_len": args.prefix_len,
            "conversations": args.conversations,
            "max_tokens": args.max_tokens,
        }
        report = bench_prefix.prefix_report(cfg, source.args(), result, settings, command=command)
        bench_report.write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        bench_prefix.plot_prefix(result, args.plot)
    return 0


def _set_threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(max(1, n))


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
