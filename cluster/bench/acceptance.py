"""`mtpserve bench acceptance`: draft acceptance over a prompts file, incl. TensorRT-LLM PR #18295's comparison.

Prompts run one at a time (so chunk boundaries fall exactly every `chunk_size` tokens, whatever the token
budget), greedy, and the per-request speculation counters are summed. Engines come from an
`EngineFactory` (the CLI passes `mtpserve.cluster.distributed.build.build_engine`; tests pass tiny in-memory models).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpserve.cluster.bench.report import BenchError, EngineFactory, environment, model_info, table, with_sections
from mtpserve.cluster.engine.chat_encoding import encode_text
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.stats import SpecStats
from mtpserve.workers.config import MTPServeConfig

PROMPT_FIELDS = ("prompt", "turns", "question", "text")


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
    return [text for text, _ in load_prompt_records(path, num_prompts)]


def prompt_is_chat(record: dict[str, Any], where: str = "record") -> bool:
    """Whether a record's prompt goes through the chat template: its `format` is 'chat' (default) or 'raw'."""
    fmt = record.get("format", "chat")
    if fmt not in ("chat", "raw"):
        raise BenchError(f"{where}: format must be 'chat' or 'raw', got {fmt!r}")
    return bool(fmt == "chat")


def load_prompt_records(path: str | Path, num_prompts: int | None = None) -> list[tuple[str, bool]]:
    """(text, chat) per prompt of a JSONL file (blank lines skipped), at most `num_prompts` of them."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"prompts file {path} does not exist")
    texts: list[tuple[str, bool]] = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if num_prompts is not None and len(texts) >= num_prompts:
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
        where = f"{path}:{i}"
        texts.append((prompt_text(record, where), prompt_is_chat(record, where)))
    if not texts:
        raise BenchError(f"{path} holds no prompts")
    return texts


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
    by_group: dict[str, SpecStats] = field(default_factory=dict)  # per prompt file

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
            "by_group": {g: st.to_dict() for g, st in self.by_group.items()},
            "per_prompt": self.per_prompt,
        }


def setting_config(cfg: MTPServeConfig, setting: AcceptanceSetting, longest_prompt: int) -> MTPServeConfig:
    """cfg with the setting's lookahead source and chunk size, drafting K every step (not adaptive, so the
    counters read acceptance at K); the step budget never splits a chunk further."""
    chunk = setting.chunk_size if setting.chunk_size is not None else longest_prompt
    budget = max(cfg.scheduler.max_num_batched_tokens, chunk)
    return with_sections(
        cfg,
        speculative={"lookahead_source": setting.lookahead_source, "enabled": True, "adaptive": False},
        scheduler={"chunk_size": chunk, "max_num_batched_tokens": budget},
    )


def run_acceptance(
    factory: EngineFactory,
    cfg: MTPServeConfig,
    setting: AcceptanceSetting,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    progress: bool = True,
    groups: Sequence[str] | None = None,
) -> AcceptanceResult:
    """Greedy-decode every prompt, one at a time, under `setting` and sum the speculation counters (also per
    group, e.g. per prompt file, when `groups` labels each prompt)."""
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
            stats=SpecStats(),
            num_prompts=len(prompts),
        )
        t0 = time.perf_counter()
        for i, ids in enumerate(tqdm(prompts, desc=setting.name, unit="prompt", disable=not progress)):
            (done,) = engine.generate([ids], params)
            result.stats.merge(done.stats)
            if groups is not None:
                result.by_group.setdefault(groups[i], SpecStats()).merge(done.stats)
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
                    **({"group": groups[i]} if groups is not None else {}),
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
    *,
    ignore_eos: bool = False,
    progress: bool = True,
    groups: Sequence[str] | None = None,
) -> list[AcceptanceResult]:
    """`run_acceptance` for each setting on the same prompts."""
    return [
        run_acceptance(
            factory,
            cfg,
            s,
            prompts=prompts,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            progress=progress,
            groups=groups,
        )
        for s in settings
    ]


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
    return table(head, body)


def format_group_table(results: list[AcceptanceResult]) -> str:
    """One row per (setting, prompt group): prompts' acceptance length and per-position rates."""
    head = ["setting", "prompts", "accepted/drafted", "acc len", "per position"]
    body = [
        [
            r.setting.name,
            group,
            f"{st.accepted}/{st.drafted}",
            f"{st.acceptance_length:.4f}",
            " ".join(f"{x:.3f}" for x in st.per_position_rates()),
        ]
        for r in results
        for group, st in r.by_group.items()
    ]
    return table(head, body)


def encode_texts(tokenizer: Any, texts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids of each text (chat template unless chat is False), before any engine is built."""
    return [encode_text(tokenizer, t, chat) for t in texts]
