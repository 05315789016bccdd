"""`mtpserve bench prefix-cache`: multi-turn chats over one long shared document, with and without
prefix caching.

Each conversation is a system prompt (an instruction and the same document of about --prefix-len
tokens), a first question, the model's reply and a follow-up question. For each mode the benchmark runs:

- sequential: every first turn alone, then every second turn alone; time to first token (TTFT) per
  request. With caching, the first conversation pays for the document and the others reuse it; every
  second turn reuses its whole first turn.
- concurrent: the cache emptied, all first turns at once, then all second turns at once; output tok/s
  and mean TTFT per turn.

Greedy decoding, so the two modes must give the same tokens and the same acceptance; the report says
whether they did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch

from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench.report import BenchError, EngineFactory, environment, model_info, table, with_sections
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "architecture.md")
SYSTEM = "You answer questions about the document below. Be brief and precise.\n\n"
QUESTIONS = (
    "What problem does this project solve?",
    "Which packages does the service need?",
    "How are requests scheduled?",
    "What does the draft head read at each position?",
    "How is the service deployed on Kubernetes?",
    "What happens when a worker fails?",
    "How is acceptance measured?",
    "Which command runs the tests?",
    "What are CUDA graphs used for here?",
    "How do the actors talk to each other?",
    "What is tensor parallelism used for?",
    "What does the benchmark folder hold?",
)
FOLLOW_UPS = (
    "Can you say that in one sentence?",
    "Why does that matter to users?",
    "Give one concrete example.",
    "What would go wrong otherwise?",
)


@dataclass
class Conversation:
    """One chat: the shared system prompt, a first question and a follow-up."""

    system: str
    question: str
    follow_up: str
    reply: str = ""  # the model's first answer, filled in by the first turn


@dataclass
class RequestRun:
    """One request measured alone: its TTFT, the engine steps until then, its tokens and acceptance."""

    prompt_tokens: int
    ttft_ms: float
    prefill_steps: int
    token_ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


def load_documents(paths: list[Path], tokenizer: Any, num_tokens: int) -> tuple[str, str]:
    """The first `num_tokens` tokens of the files' text, as text; and a warm-up text of as many tokens
    that shares no prefix with it (the same tokens reversed)."""
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise BenchError(f"--document: no such file: {', '.join(missing)}")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise BenchError(f"--document holds {len(ids)} tokens, fewer than --prefix-len {num_tokens}")
    head = ids[:num_tokens]
    return str(tokenizer.decode(head)), str(tokenizer.decode(head[::-1]))


def conversations(document: str, n: int) -> list[Conversation]:
    """n conversations over the same document, each with its own questions."""
    return [
        Conversation(SYSTEM + document, QUESTIONS[i % len(QUESTIONS)], FOLLOW_UPS[i % len(FOLLOW_UPS)])
        for i in range(n)
    ]


def chat_ids(tokenizer: Any, conv: Conversation, turn: int) -> list[int]:
    """Token ids of the conversation's first (turn 1) or second (turn 2) request."""
    messages = [{"role": "system", "content": conv.system}, {"role": "user", "content": conv.question}]
    if turn == 2:
        messages += [{"role": "assistant", "content": conv.reply}, {"role": "user", "content": conv.follow_up}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _sync(engine: LLMEngine) -> None:
    runner = bench_report.local_runner(engine)
    if runner is not None and runner.device.type == "cuda":
        torch.cuda.synchronize()


def _drive(engine: LLMEngine, consume: Callable[[list[Any], int], None]) -> None:
    """Step until idle; outputs reach consume(outputs, step number from 1) as a server's streams get
    them: a step's tokens before its draft runs (see `LLMEngine.on_tokens`)."""
    step = [1]
    engine.on_tokens = lambda outs: consume(outs, step[0])
    try:
        while engine.has_unfinished():
            consume(engine.step(), step[0])
            step[0] += 1
    finally:
        engine.on_tokens = None


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> RequestRun:
    """One request on an otherwise idle engine, to its end."""
    _sync(engine)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, {"max_tokens": max_tokens})
    run = RequestRun(len(prompt), 0.0, 0)

    def consume(outs: list[Any], step: int) -> None:
        for o in outs:
            if o.request_id != rid:
                continue
            if o.new_token_ids and not run.ttft_ms:
                run.ttft_ms, run.prefill_steps = 1e3 * (time.perf_counter() - t0), step
            run.token_ids += o.new_token_ids
            run.drafted, run.accepted = o.stats.drafted, o.stats.accepted

    _drive(engine, consume)
    return run


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """All prompts at once: wall time, output tok/s and mean TTFT."""
    _sync(engine)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, {"max_tokens": max_tokens}) for p in prompts]
    first: dict[str, float] = {}
    tokens = [0]

    def consume(outs: list[Any], step: int) -> None:
        now = time.perf_counter()
        for o in outs:
            tokens[0] += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0

    _drive(engine, consume)
    _sync(engine)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "output_tokens": tokens[0],
        "tok_per_s": tokens[0] / wall,
        "mean_ttft_ms": 1e3 * sum(first[r] for r in rids) / len(rids),
    }


def run_mode(
    engine: LLMEngine,
    convs: list[Conversation],
    warmup: list[Conversation],
    tokenizer: Any,
    max_tokens: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Both passes on one engine (its caching already set); fills each conversation's reply. The same
    passes run first on `warmup` (another document, so nothing is reused), to compile kernels and capture
    graphs for these shapes before anything is timed."""
    for conv in warmup[:1]:
        conv.reply = engine.decode(run_alone(engine, chat_ids(tokenizer, conv, 1), max_tokens).token_ids)
        run_alone(engine, chat_ids(tokenizer, conv, 2), max_tokens)
    for conv in warmup[1:]:
        conv.reply = warmup[0].reply
    run_batch(engine, [chat_ids(tokenizer, c, 1) for c in warmup], max_tokens)
    run_batch(engine, [chat_ids(tokenizer, c, 2) for c in warmup], max_tokens)
    engine.scheduler.forget_cached()
    first, second = [], []
    for i, conv in enumerate(convs):
        run = run_alone(engine, chat_ids(tokenizer, conv, 1), max_tokens)
        conv.reply = engine.decode(run.token_ids)
        first.append(run)
        progress(f"turn 1, conversation {i + 1}/{len(convs)}: TTFT {run.ttft_ms:.1f} ms")
    for i, conv in enumerate(convs):
        second.append(run_alone(engine, chat_ids(tokenizer, conv, 2), max_tokens))
        progress(f"turn 2, conversation {i + 1}/{len(convs)}: TTFT {second[-1].ttft_ms:.1f} ms")
    hits = engine.scheduler.prefix_hit_tokens
    engine.scheduler.forget_cached()
    batch1 = run_batch(engine, [chat_ids(tokenizer, c, 1) for c in convs], max_tokens)
    batch2 = run_batch(engine, [chat_ids(tokenizer, c, 2) for c in convs], max_tokens)
    return {
        "prefix_caching": engine.scheduler.prefix_caching,
        "sequential": {"turn1": [asdict(r) for r in first], "turn2": [asdict(r) for r in second]},
        "sequential_hit_tokens": hits,
        "ttft_ms": {
            "turn1_first": first[0].ttft_ms,
            "turn1_rest_median": median(r.ttft_ms for r in first[1:]) if len(first) > 1 else None,
            "turn2_median": median(r.ttft_ms for r in second),
        },
        "concurrent": {"turn1": batch1, "turn2": batch2},
    }


def bench_config(cfg: MTPServeConfig, num_conversations: int, longest: int, max_tokens: int) -> MTPServeConfig:
    """cfg with room for every conversation at once and a cache that holds all their turns unevicted, drafting K
    every step (not adaptive: the two modes' acceptance must be comparable)."""
    block = cfg.scheduler.block_size
    per_conv = 2 * (longest + 2 * max_tokens + 16)  # both turns stay cached
    sched: dict[str, Any] = {"max_num_requests": max(cfg.scheduler.max_num_requests, num_conversations)}
    if cfg.scheduler.num_kv_blocks is None:
        sched["num_kv_blocks"] = -(-(num_conversations + 2) * per_conv // block)
    model = {"max_model_len": max(cfg.model.max_model_len or 0, longest + 4 * max_tokens + 64)}
    return with_sections(cfg, scheduler=sched, model=model, speculative={"adaptive": False})


def run_prefix_bench(
    build: EngineFactory,
    cfg: MTPServeConfig,
    tokenizer: Any,
    document: str,
    warmup_document: str,
    num_conversations: int,
    max_tokens: int,
    *,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Run both modes; the results, the equality checks and the uncached/cached ratios."""
    if num_conversations < 2:
        raise BenchError("--conversations must be at least 2 (the first one fills the cache)")
    modes: dict[str, dict[str, Any]] = {}
    replies: dict[str, list[str]] = {}
    first, second = (chat_ids(tokenizer, c, 1) for c in conversations(document, 2))
    prefix_tokens = next((i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y), len(first))
    longest = len(first) + 2 * max_tokens + 32
    for name, caching in (("cached", True), ("uncached", False)):
        convs = conversations(document, num_conversations)  # fresh: each mode fills in its own replies
        warm = conversations(warmup_document, num_conversations)
        engine = build(
            bench_config(
                with_sections(cfg, scheduler={"prefix_caching": caching}), num_conversations, longest, max_tokens
            )
        )
        try:
            progress(f"{name}: prefix caching {'on' if engine.scheduler.prefix_caching else 'off'}")
            modes[name] = run_mode(engine, convs, warm, tokenizer, max_tokens=max_tokens, progress=progress)
            modes[name]["engine"] = {"scheduler": engine.scheduler.cfg.model_dump()}
        finally:
            engine.shutdown()
        replies[name] = [c.reply for c in convs]
    on, off = modes["cached"], modes["uncached"]

    def runs(mode: dict[str, Any]) -> list[dict[str, Any]]:
        return mode["sequential"]["turn1"] + mode["sequential"]["turn2"]

    same_tokens = [x["token_ids"] == y["token_ids"] for x, y in zip(runs(on), runs(off), strict=True)]
    same_accept = [
        (x["drafted"], x["accepted"]) == (y["drafted"], y["accepted"]) for x, y in zip(runs(on), runs(off), strict=True)
    ]
    ratios = {
        key: (off["ttft_ms"][key] / on["ttft_ms"][key]) if on["ttft_ms"][key] else None
        for key in ("turn1_first", "turn1_rest_median", "turn2_median")
        if on["ttft_ms"][key] is not None
    }
    for turn in ("turn1", "turn2"):
        ratios[f"concurrent_{turn}_tok_per_s"] = (
            on["concurrent"][turn]["tok_per_s"] / off["concurrent"][turn]["tok_per_s"]
        )
    return {
        "shared_prefix_tokens": prefix_tokens,
        "modes": modes,
        "uncached_over_cached_ttft_and_cached_over_uncached_tok_s": ratios,
        "equal": {
            "tokens": sum(same_tokens) / len(same_tokens),
            "acceptance": sum(same_accept) / len(same_accept),
            "replies": replies["cached"] == replies["uncached"],
        },
    }


def prefix_report(
    cfg: MTPServeConfig, args: Any, result: dict[str, Any], settings: dict[str, Any], command: str
) -> dict[str, Any]:
    """The JSON document of a prefix-cache run."""
    spec = cfg.speculative
    return {
        "benchmark": "prefix_cache",
        "command": command,
        **environment(cfg),
        "model": model_info(cfg, args),
        "speculation": {"enabled": spec.enabled, "draft": spec.draft, "num_draft_tokens": spec.num_draft_tokens},
        "settings": settings,
        **result,
    }


def format_prefix_table(result: dict[str, Any]) -> str:
    """TTFT and tok/s per mode, and the ratios."""
    head = ["mode", "TTFT turn 1 first ms", "TTFT turn 1 rest ms", "TTFT turn 2 ms", "tok/s turn 1", "tok/s turn 2"]
    body = []
    for name, m in result["modes"].items():
        t, c = m["ttft_ms"], m["concurrent"]
        rest = "-" if t["turn1_rest_median"] is None else f"{t['turn1_rest_median']:.1f}"
        body.append(
            [
                name,
                f"{t['turn1_first']:.1f}",
                rest,
                f"{t['turn2_median']:.1f}",
                f"{c['turn1']['tok_per_s']:.1f}",
                f"{c['turn2']['tok_per_s']:.1f}",
            ]
        )
    r = result["uncached_over_cached_ttft_and_cached_over_uncached_tok_s"]
    body.append(
        [
            "ratio",
            *(
                f"{r[k]:.2f}x" if k in r else "-"
                for k in (
                    "turn1_first",
                    "turn1_rest_median",
                    "turn2_median",
                    "concurrent_turn1_tok_per_s",
                    "concurrent_turn2_tok_per_s",
                )
            ),
        ]
    )
    eq = result["equal"]
    return (
        table(head, body) + f"\nshared prefix {result['shared_prefix_tokens']} tokens; equal tokens "
        f"{eq['tokens']:.0%}, equal acceptance {eq['acceptance']:.0%} of requests"
    )


def plot_prefix(result: dict[str, Any], path: str) -> None:
    """TTFT (ms) per turn, cached against uncached, as grouped bars."""
    bars = {
        label: {mode: result["modes"][mode]["ttft_ms"][key] or 0.0 for mode in ("cached", "uncached")}
        for key, label in (
            ("turn1_first", "first turn, first chat"),
            ("turn1_rest_median", "first turns, rest"),
            ("turn2_median", "second turns"),
        )
    }
    bench_report.plot_bars(path, bars, "prefix caching: TTFT alone", "ms (median)")
