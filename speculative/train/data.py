"""The draft-training dataset: a mix of recipes built in parts, resumable and shardable, and its loader.

Nothing is downloaded. `DataConfig.mix` says how many parts of each recipe (see `recipes.py`) to build,
`part_size` how many samples a part aims at. Parts are interleaved across recipes, so a run cut short
still covers every kind. Each part is a pure function of (seed, recipe, part), is written atomically as
`parts/<recipe>-<part>.pt` once complete, and is skipped when it already exists: a second run continues
where the first stopped. `shard=(w, n)` builds only parts w, w+n, ... (one of n processes sharing a GPU).
When every part exists, `meta.json` lists them with the counts and the exact settings.

Per sequence the store keeps the token ids (prompt + response) and where the response starts; target
hidden states are not stored, the trainer recomputes them with a dense forward of the target.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train.errors import TrainSetupError
from mtpserve.speculative.train.generators import Generator
from mtpserve.speculative.train.recipes import RecipeContext, RecipeSettings, Sample, make_recipe

log = logging.getLogger(__name__)
FORMAT = "mtpserve-draft-data/2"
HIDDEN_NOTE = "not stored: the trainer recomputes target hidden states with a dense forward over the token ids"
_MARK = "\u2063MAGPIE\u2063"
DEFAULT_MIX = {"chat": 2, "steered": 1, "magpie": 1, "math": 1, "code": 1, "long": 1, "multi": 1, "seed": 1}


@dataclass
class DataConfig:
    """What the dataset holds and how it is built (recorded in meta.json)."""

    mix: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MIX))  # recipe -> parts
    part_size: int = 64  # samples a part aims at (`seed` parts hold at most the seed list)
    settings: RecipeSettings = field(default_factory=RecipeSettings)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (target, generator, ...)

    def plan(self) -> list[tuple[str, int]]:
        """Every (recipe, part), interleaved across recipes in mix order."""
        out: list[tuple[str, int]] = []
        for i in range(max(self.mix.values(), default=0)):
            out += [(name, i) for name, n in self.mix.items() if i < n]
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What makes parts of two runs interchangeable (everything but provenance)."""
        d = asdict(self)
        d.pop("extra")
        return d


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

        A prompt is answered once (a conversation's first turn also opens its second), so a held-apart
        sequence is a held-apart prompt. Sequences from `holdout_sources` (e.g. "seed": the hand-written
        prompts) all go to dev when greedy and are dropped when sampled; then a random `dev_fraction` of the
        remaining sequences (greedy ones) joins dev.
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


# ---- chat template helpers -----------------------------------------------------------------------
def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user turn wrapped in the chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def turn_end_ids(tokenizer: Any) -> list[int]:
    """The special token the chat template places right after a user's text (e.g. <|im_end|>), or []."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if _MARK not in text:
        raise TrainSetupError("--target", "the chat template does not render the user message")
    tail = text.split(_MARK, 1)[1]
    tail_ids = [int(t) for t in tokenizer.encode(tail, add_special_tokens=False)] if tail else []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [tail_ids[0]] if tail_ids and (tail_ids[0] in special or tail_ids[0] in added) else []


# ---- building ------------------------------------------------------------------------------------
def part_path(root: Path, recipe: str, part: int) -> Path:
    """Where one finished part lives."""
    return root / "parts" / f"{recipe}-{part:04d}.pt"


def recipe_context(generator: Generator, tokenizer: Any, args: LlamaArgs, cfg: DataConfig) -> RecipeContext:
    """The context recipes build with: stop ids are the target's EOS ids plus the chat turn end."""
    turn_end = turn_end_ids(tokenizer) if tokenizer is not None else []
    stop = tuple(sorted(set(args.eos_ids()) | set(turn_end)))
    return RecipeContext(generator, tokenizer, args, cfg.settings, stop_ids=stop, turn_end=turn_end)


def _check_plan(root: Path, cfg: DataConfig) -> None:
    """Record the configuration; refuse to mix parts of two configurations in one folder."""
    path = root / "plan.json"
    want = json.loads(json.dumps(cfg.fingerprint(), default=str))
    if path.is_file():
        have = json.loads(path.read_text())
        if have != want:
            raise TrainSetupError(
                "--data-dir",
                f"'{root}' holds parts built with other settings; use another folder or --rebuild-data",
            )
        return
    root.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(want, indent=2))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save_part(path: Path, samples: list[Sample], wall_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "ids": [torch.tensor(s.ids, dtype=torch.int32) for s in samples],
        "response_start": [s.response_start for s in samples],
        "greedy": [s.greedy for s in samples],
        "source": [s.source for s in samples],
        "finish": [s.finish for s in samples],
        "wall_s": wall_s,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(record, tmp)
    os.replace(tmp, path)


def build_parts(
    out_dir: str | Path,
    generator: Generator,
    tokenizer: Any,
    args: LlamaArgs,
    cfg: DataConfig,
    shard: tuple[int, int] = (0, 1),
    deadline: float | None = None,
) -> dict[str, Any]:
    """Build this shard's missing parts (stopping before `deadline`, a time.time() value, when the next part
    would not fit), then write meta.json if every part exists. Returns the progress."""
    root = Path(out_dir)
    missing_tok = sorted({r for r in cfg.mix if make_recipe(r).needs_tokenizer and cfg.mix[r] > 0})
    if tokenizer is None and missing_tok:
        raise TrainSetupError("--mix", f"recipes {missing_tok} need a tokenizer; this target has none (use random)")
    _check_plan(root, cfg)
    w, n = shard
    mine = [(i, r, p) for i, (r, p) in enumerate(cfg.plan()) if i % n == w]
    todo = [(r, p) for _, r, p in mine if not part_path(root, r, p).is_file()]
    ctx = recipe_context(generator, tokenizer, args, cfg)
    built, longest = 0, 0.0
    with tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"data parts (shard {w}/{n})", unit="part") as bar:
        for recipe, part in todo:
            if deadline is not None and time.time() + 1.2 * longest > deadline:
                log.info("time budget: stopping before %s-%04d; run again to continue", recipe, part)
                break
            path = part_path(root, recipe, part)
            if path.is_file():  # another process finished it meanwhile
                bar.update(1)
                continue
            t0 = time.perf_counter()
            samples = make_recipe(recipe).build(ctx, part, cfg.part_size, cfg.seed)
            wall = time.perf_counter() - t0
            _save_part(path, samples, wall)
            longest, built = max(longest, wall), built + 1
            bar.update(1)
            bar.set_postfix({"last": f"{recipe}-{part} {len(samples)} seqs {wall:.0f}s"})
    return finalize(root, cfg, generator.name) | {"built_now": built}


def finalize(root: Path, cfg: DataConfig, generator_name: str) -> dict[str, Any]:
    """Write meta.json when every planned part exists; returns {complete, parts_done, parts_total}."""
    plan = cfg.plan()
    done = [(r, p) for r, p in plan if part_path(root, r, p).is_file()]
    status = {"complete": len(done) == len(plan), "parts_done": len(done), "parts_total": len(plan)}
    if not status["complete"]:
        return status
    by_source: dict[str, int] = {}
    seqs = tokens = resp = greedy = stopped = 0
    build_s = 0.0
    for r, p in plan:
        part = torch.load(part_path(root, r, p), weights_only=True)
        for ids, start, g, src, fin in zip(
            part["ids"], part["response_start"], part["greedy"], part["source"], part["finish"], strict=True
        ):
            seqs += 1
            tokens += int(ids.numel())
            resp += int(ids.numel()) - int(start)
            greedy += bool(g)
            stopped += fin == "stop"
            by_source[src] = by_source.get(src, 0) + 1
        build_s += float(part.get("wall_s", 0.0))
    meta = {
        "format": FORMAT,
        "hidden_states": HIDDEN_NOTE,
        "generator": generator_name,
        "counts": {
            "sequences": seqs,
            "tokens": tokens,
            "response_tokens": resp,
            "by_source": by_source,
            "greedy": greedy,
            "sampled": seqs - greedy,
            "finished_stop": stopped,
        },
        "settings": asdict(cfg),
        "shards": [str(part_path(root, r, p).relative_to(root)) for r, p in plan],
        "build_wall_s": round(build_s, 2),
    }
    _atomic_write(root / "meta.json", json.dumps(meta, indent=2, default=str))
    return status


def load_dataset(path: str | Path) -> TokenDataset:
    """Read a dataset folder; raises TrainSetupError when it is missing, unfinished or holds no sequences."""
    root = Path(path)
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        hint = "finish it" if (root / "plan.json").is_file() else "build it"
        raise TrainSetupError(
            "--data-dir", f"'{root}' has no meta.json; {hint} with `mtpserve train-draft --stage data`"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise TrainSetupError("--data-dir", f"'{root}' is not a {FORMAT} dataset (format {meta.get('format')!r})")
    ds = TokenDataset([], [], [], [], meta=meta)
    for name in meta.get("shards", []):
        shard = torch.load(root / name, weights_only=True)
        ds.ids += [t.long() for t in shard["ids"]]
        ds.response_start += [int(x) for x in shard["response_start"]]
        ds.greedy += [bool(x) for x in shard["greedy"]]
        ds.source += list(shard["source"])
    if len(ds) == 0:
        raise TrainSetupError("--data-dir", f"dataset '{root}' is empty (0 sequences); rebuild it with more parts")
    return ds
