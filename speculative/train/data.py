"""The draft-training dataset: prompts (built-in seeds + Magpie-style self-written), target responses, storage.

Nothing is downloaded. Prompts come from `seed_prompts.SEED_PROMPTS` and from the target itself: given
only its chat template's header up to the user turn, it writes a user message (Magpie). The target then
answers every prompt, greedily or by sampling. Per sequence the folder stores the token ids
(prompt + response) and the index where the response starts; target hidden states are not stored,
the trainer recomputes them with a dense forward of the target.

Layout: `meta.json` (counts and the exact settings) and `shard-00000.pt`, ... each a dict of lists:
ids (int32 tensors), response_start, greedy, source, finish.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculative.train.errors import TrainSetupError
from speculative.train.generators import Generator, GenResult, GenSettings
from speculative.train.openers import OPENERS
from speculative.train.seed_prompts import SEED_PROMPTS
from workers.model import LlamaArgs

FORMAT = "mtpserve-draft-data/1"
HIDDEN_NOTE = "not stored: the trainer recomputes target hidden states with a dense forward over the token ids"
_MARK = "\u2063MAGPIE\u2063"


@dataclass
class DataConfig:
    """How the dataset is built (all of it is recorded in meta.json)."""

    num_prompts: int = len(SEED_PROMPTS)  # built-in seed prompts (random token prompts without a tokenizer)
    magpie_prompts: int = 256  # self-written prompts to keep
    max_new_tokens: int = 256  # response length cap
    magpie_max_tokens: int = 96  # user-message length cap while the target writes prompts
    magpie_temperature: float = 1.0
    magpie_top_p: float = 0.95
    magpie_oversample: float = 1.5  # candidates drawn per kept prompt (filtering drops about a quarter)
    steered_prompts: int = 0  # self-written prompts whose user turn starts with a built-in opener
    min_prompt_chars: int = 12
    sampled_fraction: float = 0.2  # responses sampled instead of greedy
    response_temperature: float = 0.7
    response_top_p: float = 0.95
    max_prompt_tokens: int = 384
    seed: int = 0
    shard_size: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (target, generator, ...)


@dataclass
class Prompt:
    """A prompt's token ids, where it came from, and its text when known."""

    ids: list[int]
    source: str
    text: str = ""


@dataclass
class TokenDataset:
    """Token-id sequences with response starts; hidden states are recomputed by the trainer."""

    ids: list[torch.Tensor]  # each int64 [L_i]: prompt + response
    response_start: list[int]  # index of the first response token in ids[i]
    greedy: list[bool]
    source: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        """Sequence lengths."""
        return [int(t.numel()) for t in self.ids]

    def split(
        self, dev_fraction: float, seed: int, holdout_sources: tuple[str, ...] = ()
    ) -> tuple[list[int], list[int]]:
        """(train, dev) indices. Dev holds only greedy sequences (exact teacher-forced acceptance).

        Each prompt is answered once, so a held-apart sequence is a held-apart prompt. Sequences from
        `holdout_sources` (e.g. "seed": the hand-written prompts, another distribution than the
        self-written ones) all go to dev when greedy and are dropped when sampled; then a random
        `dev_fraction` of the remaining sequences (greedy ones) joins dev.
        """
        n = len(self)
        held = {i for i in range(n) if self.source[i] in holdout_sources}
        rest = [i for i in range(n) if i not in held]
        greedy = [i for i in rest if self.greedy[i]]
        want = round(dev_fraction * len(rest))
        if dev_fraction > 0:
            want = max(1, want)
        want = min(want, len(greedy), len(rest) - 1)
        rng = random.Random(seed)
        dev = set(rng.sample(greedy, want)) if want > 0 else set()
        dev |= {i for i in held if self.greedy[i]}
        return [i for i in rest if i not in dev], sorted(dev)


# ---- prompts -------------------------------------------------------------------------------------
def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user turn wrapped in the chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def magpie_prefix(tokenizer: Any) -> tuple[list[int], list[int], str]:
    """(header ids, end-of-turn ids, header text): the template rendered up to the user message.

    The header includes whatever system turn the template adds by default. The end-of-turn id is the
    first token the template places after the user's text (e.g. <|im_end|>).
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if _MARK not in text:
        raise TrainSetupError("--target", "the chat template does not render the user message")
    head, tail = text.split(_MARK, 1)
    header = [int(t) for t in tokenizer.encode(head, add_special_tokens=False)]
    tail_ids = [int(t) for t in tokenizer.encode(tail, add_special_tokens=False)] if tail else []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    stop = [tail_ids[0]] if tail_ids and (tail_ids[0] in special or tail_ids[0] in added) else []
    return header, stop, head


def seed_prompts(tokenizer: Any, args: LlamaArgs, n: int, seed: int) -> list[Prompt]:
    """The first n built-in prompts, or n random token prompts when the target has no tokenizer."""
    if tokenizer is not None:
        return [Prompt(chat_prompt_ids(tokenizer, t), "seed", t) for t in SEED_PROMPTS[:n]]
    g = torch.Generator().manual_seed(seed)
    lo = min(3, args.vocab_size - 1)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 21, (1,), generator=g))
        out.append(Prompt(torch.randint(lo, args.vocab_size, (length,), generator=g).tolist(), "random"))
    return out


def magpie_prompts(
    generator: Generator, tokenizer: Any, args: LlamaArgs, cfg: DataConfig, stop_extra: list[int]
) -> tuple[list[Prompt], dict[str, Any]]:
    """Let the target write user messages from the bare user header; keep distinct, non-trivial ones."""
    return self_written_prompts(generator, tokenizer, args, cfg, stop_extra, cfg.magpie_prompts, (), "magpie", 7919)


def steered_prompts(
    generator: Generator, tokenizer: Any, args: LlamaArgs, cfg: DataConfig, stop_extra: list[int]
) -> tuple[list[Prompt], dict[str, Any]]:
    """Like `magpie_prompts`, but each user turn starts with a built-in opener (cycled) for variety."""
    if tokenizer is None:
        return [], {"candidates": 0, "kept": 0, "note": "needs a tokenizer"}
    return self_written_prompts(
        generator, tokenizer, args, cfg, stop_extra, cfg.steered_prompts, OPENERS, "steered", 15485863
    )


def self_written_prompts(
    generator: Generator,
    tokenizer: Any,
    args: LlamaArgs,
    cfg: DataConfig,
    stop_extra: list[int],
    count: int,
    openers: tuple[str, ...],
    source: str,
    seed_offset: int,
) -> tuple[list[Prompt], dict[str, Any]]:
    """Have the target write `count` distinct user messages, each begun by an opener when given."""
    if count <= 0:
        return [], {"candidates": 0, "kept": 0}
    if tokenizer is not None:
        header, turn_end, header_text = magpie_prefix(tokenizer)
    else:
        header, turn_end, header_text = [args.bos_token_id if args.bos_token_id is not None else 1], [], ""
    stop = tuple(sorted(set(turn_end) | set(args.eos_ids()) | set(stop_extra)))
    n_cand = max(count, int(count * cfg.magpie_oversample))
    starts = [[int(t) for t in tokenizer.encode(o, add_special_tokens=False)] for o in openers] or [[]]
    seed = cfg.seed + seed_offset
    settings = GenSettings(cfg.magpie_max_tokens, cfg.magpie_temperature, cfg.magpie_top_p, seed, stop)
    cands = [list(header) + starts[i % len(starts)] for i in range(n_cand)]
    outs = generator.generate(cands, settings, desc=f"{source} prompts")
    kept: list[Prompt] = []
    seen: set[str] = set()
    for cand, res in zip(cands, outs, strict=True):
        body = cand[len(header) :] + [t for t in res.token_ids if t not in stop]
        if tokenizer is not None:
            if res.finish_reason != "stop":
                continue  # ran past magpie_max_tokens: usually rambling, not a request
            text = tokenizer.decode(body, skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if len(text) < cfg.min_prompt_chars or len(text.split()) < 3 or key in seen:
                continue
            ids = chat_prompt_ids(tokenizer, text)
        else:
            text, key = "", " ".join(map(str, body))
            if len(body) < 4 or key in seen:
                continue
            ids = list(header) + body
        if len(ids) > cfg.max_prompt_tokens:
            continue
        seen.add(key)
        kept.append(Prompt(ids, source, text))
        if len(kept) == count:
            break
    info: dict[str, Any] = {"candidates": n_cand, "kept": len(kept), "header": header_text or header}
    if openers:
        info["openers"] = len(openers)
    return kept, info


# ---- responses and storage -----------------------------------------------------------------------
def respond(
    generator: Generator, prompts: list[Prompt], cfg: DataConfig, stop: tuple[int, ...]
) -> list[tuple[Prompt, GenResult, bool]]:
    """Answer every prompt: greedy, or sampled for a `sampled_fraction` share chosen by the seed."""
    rng = random.Random(cfg.seed)
    sampled = [rng.random() < cfg.sampled_fraction for _ in prompts]
    out: list[tuple[Prompt, GenResult, bool] | None] = [None] * len(prompts)
    for mode in (False, True):
        idx = [i for i, s in enumerate(sampled) if s == mode]
        if not idx:
            continue
        temp, top_p = (cfg.response_temperature, cfg.response_top_p) if mode else (0.0, 1.0)
        settings = GenSettings(cfg.max_new_tokens, temp, top_p, cfg.seed + (104729 if mode else 0), stop)
        res = generator.generate(
            [prompts[i].ids for i in idx], settings, "responses " + ("sampled" if mode else "greedy")
        )
        for i, r in zip(idx, res, strict=True):
            out[i] = (prompts[i], r, not mode)
    return [o for o in out if o is not None]


def build_dataset(
    out_dir: str | Path,
    generator: Generator,
    tokenizer: Any,
    args: LlamaArgs,
    cfg: DataConfig,
) -> dict[str, Any]:
    """Build prompts and responses with `generator`, write shards + meta.json, and return the meta."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop_extra: list[int] = []
    if tokenizer is not None:
        _, stop_extra, _ = magpie_prefix(tokenizer)
    stop = tuple(sorted(set(args.eos_ids()) | set(stop_extra)))
    prompts = seed_prompts(tokenizer, args, cfg.num_prompts, cfg.seed)
    mag, mag_info = magpie_prompts(generator, tokenizer, args, cfg, stop_extra)
    steered, steered_info = steered_prompts(generator, tokenizer, args, cfg, stop_extra)
    prompts += mag + steered
    if not prompts:
        raise TrainSetupError(
            "--num-prompts", "no prompts: give --num-prompts, --magpie-prompts and/or --steered-prompts > 0"
        )
    answered = respond(generator, prompts, cfg, stop)
    records: dict[str, list[Any]] = {k: [] for k in ("ids", "response_start", "greedy", "source", "finish")}
    for p, r, greedy in answered:
        if len(r.token_ids) < 2:
            continue
        records["ids"].append(torch.tensor(p.ids + r.token_ids, dtype=torch.int32))
        records["response_start"].append(len(p.ids))
        records["greedy"].append(greedy)
        records["source"].append(p.source)
        records["finish"].append(r.finish_reason)
    n = len(records["ids"])
    for old in out.glob("shard-*.pt"):
        old.unlink()
    shards = []
    for s, lo in enumerate(range(0, n, cfg.shard_size)):
        name = f"shard-{s:05d}.pt"
        torch.save({k: v[lo : lo + cfg.shard_size] for k, v in records.items()}, out / name)
        shards.append(name)
    total = sum(int(t.numel()) for t in records["ids"])
    resp = total - sum(records["response_start"])
    by_source: dict[str, int] = {}
    for src in records["source"]:
        by_source[src] = by_source.get(src, 0) + 1
    meta = {
        "format": FORMAT,
        "hidden_states": HIDDEN_NOTE,
        "generator": generator.name,
        "counts": {
            "sequences": n,
            "tokens": total,
            "response_tokens": resp,
            "by_source": by_source,
            "greedy": sum(records["greedy"]),
            "sampled": n - sum(records["greedy"]),
            "finished_stop": sum(f == "stop" for f in records["finish"]),
            "magpie": mag_info,
            "steered": steered_info,
        },
        "settings": asdict(cfg),
        "stop_ids": list(stop),
        "target_args": asdict(args),
        "shards": shards,
        "build_wall_s": round(time.perf_counter() - t0, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    return meta


def load_dataset(path: str | Path) -> TokenDataset:
    """Read a dataset folder; raises TrainSetupError when it is missing or holds no sequences."""
    root = Path(path)
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise TrainSetupError(
            "--data-dir", f"'{root}' has no meta.json; build it with `mtpserve train-draft --stage data`"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise TrainSetupError("--data-dir", f"'{root}' is not a {FORMAT} dataset (format {meta.get('format')!r})")
    ds = TokenDataset([], [], [], [], meta)
    for name in meta.get("shards", []):
        shard = torch.load(root / name, weights_only=True)
        ds.ids += [t.long() for t in shard["ids"]]
        ds.response_start += [int(x) for x in shard["response_start"]]
        ds.greedy += [bool(x) for x in shard["greedy"]]
        ds.source += list(shard["source"])
    if len(ds) == 0:
        raise TrainSetupError("--data-dir", f"dataset '{root}' is empty (0 sequences); rebuild it with more prompts")
    return ds
