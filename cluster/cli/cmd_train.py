"""`mtpserve train-draft`: build a self-distillation dataset and train an MTP Eagle or EAGLE-3 draft head."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.speculative.train.errors import TrainSetupError

if TYPE_CHECKING:
    from mtpserve.speculative.train.pipeline import TrainDraftOptions

# Flag defaults (kept literal so `mtpserve --help` does not import torch); they mirror DataConfig/TrainConfig
# (and TrainDraftOptions).
DEFAULTS = {
    "mix": "chat=2,steered=1,magpie=1,math=1,code=1,long=1,multi=1,seed=1",
    "part_size": 64,
    "max_new_tokens": 384,
    "long_max_new_tokens": 768,
    "code_max_new_tokens": 256,
    "prompt_max_tokens": 96,
    "oversample": 2.0,
    "sampled_fraction": 0.2,
    "steps": 1000,
    "batch_size": 16,
    "lr": 3e-4,
    "weight_decay": 0.0,
    "min_lr_ratio": 0.1,
    "grad_clip": 1.0,
    "num_draft_tokens": 3,
    "dev_fraction": 0.05,
    "eval_every": 200,
    "eval_batch_size": 16,
    "ckpt_every": 200,
    "prefer_margin": 0.01,
    "draft_vocab": 16384,
}
RECIPE_NAMES = ("chat", "open", "magpie", "steered", "math", "code", "long", "multi", "seed", "random")

DESCRIPTION = """\
Train an MTP Eagle draft head for a target model by self-distillation (no dataset downloads).

1. data:  a mix of recipes (--mix), each built in parts of --part-size samples by the target itself:
          chat (the target finishes user turns begun from built-in subject/request lists), steered
          (begun by generic openers), magpie (written from the bare user header), math (word
          problems), code (raw Python completion of functions from the standard library, no chat
          template), long (multi-paragraph answers), multi (second turns of conversations), seed (the
          built-in hand-written list), random (random token prompts, for targets without a tokenizer).
          Parts are written as they finish; a second run continues, --shard W/N splits the parts over
          N processes. Only token ids are stored.
2. train: soft cross-entropy against the target's next-token distribution, unrolled over K draft
          steps (--num-draft-tokens), AdamW with warmup + cosine, bf16 autocast on CUDA. Several heads
          (--head-spec, an ablation) train side by side on the same batches.
3. eval:  teacher-forced K-chain acceptance on held-apart dev prompts, every --eval-every steps.
4. out:   the chosen head (--out: safetensors; an EAGLE-3 directory with --format eagle3), one per head
          of an ablation, MODEL_CARD.md beside it (inside an EAGLE-3 directory), and a results JSON.
"""

EPILOG = """\
examples:
  mtpserve train-draft --device cuda --stage data --mix chat=12,code=6,math=4 --part-size 2048 --shard 0/3
  mtpserve train-draft --device cuda --stage train --head-spec base:layers=last \\
      --head-spec fused:layers=fused --head-spec fused-v16k:layers=fused,vocab=16384 --time-budget 560
  mtpserve train-draft --target tiny/ --load-format dummy --dummy-std 0.5 --mix random=4 --steps 200
  mtpserve train-draft --stage eval --head speculative/heads/smollm2-135m-mtp.safetensors
  mtpserve train-draft --target qwen-dir/ --format eagle3 --out qwen-eagle3/ --head-spec v32k:layers=eagle3,vocab=32768
errors exit with status 2 and name the flag, e.g. `mtpserve: train-draft: --target: '/x' does not exist`.
"""


def _bounded(
    kind: Callable[[str], float], lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: `kind(text)` within [lo, hi] (ends open when asked); errors say the range."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_bad = value < lo or (lo_open and value == lo)
        high_bad = hi is not None and (value > hi or (hi_open and value == hi))
        if low_bad or high_bad:
            rng = f"{'>' if lo_open else '>='} {lo}"
            if hi is not None:
                rng += f" and {'<' if hi_open else '<='} {hi}"
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text}")
        return value

    return parse


def _weights(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative weights, got {text!r}")
    return values


def _mix(text: str) -> dict[str, int]:
    """'chat=12,code=6' -> {'chat': 12, 'code': 6}."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or name not in RECIPE_NAMES:
            raise argparse.ArgumentTypeError(f"'{item}' is not RECIPE=PARTS with a recipe in {', '.join(RECIPE_NAMES)}")
        try:
            out[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{item}': the part count must be an integer") from None
        if out[name] < 0:
            raise argparse.ArgumentTypeError(f"'{item}': the part count must be >= 0")
    if not any(out.values()):
        raise argparse.ArgumentTypeError("the mix needs at least one part")
    return out


def _shard(text: str) -> tuple[int, int]:
    """'1/3' -> (1, 3)."""
    w, slash, n = text.partition("/")
    try:
        shard = (int(w), int(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W/N such as 0/3, got {text!r}") from None
    if not slash or shard[1] < 1 or not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"expected W/N with 0 <= W < N, got {text!r}")
    return shard


def _head_spec(text: str) -> Any:
    from mtpserve.speculative.train.heads import parse_head_spec

    try:
        return parse_head_spec(text)
    except TrainSetupError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    """Register the `train-draft` sub-command."""
    p = sub.add_parser(
        name,
        help="train an MTP Eagle draft head by self-distillation",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pos_int = _bounded(int, 1)
    nonneg_int = _bounded(int, 0)
    d = t = argparse.Namespace(**DEFAULTS)

    g = p.add_argument_group("target")
    g.add_argument("--target", help="HF Llama / Qwen2 / Qwen3 directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "gguf", "dummy"],
        default="auto",
        help="dummy = random weights for the config.json in --target (tests, smoke runs)",
    )
    g.add_argument(
        "--dummy-std",
        type=_bounded(float, 0.0, lo_open=True),
        default=0.02,
        help="weight std of a dummy target (default 0.02)",
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bf16 autocast on CUDA, fp32 on CPU",
    )
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("stages and outputs")
    g.add_argument(
        "--stage",
        choices=["all", "data", "train", "eval", "vocab"],
        default="all",
        help="all: build data if --data-dir has none, then train (default); data/train/eval: one stage; vocab: "
        "write --head to --out with a reduced draft vocabulary (--draft-vocab most frequent response tokens of "
        "the training split), no training",
    )
    g.add_argument(
        "--format",
        choices=["mtp", "eagle3"],
        default="mtp",
        help="layout of the trained heads: mtp (this project's MTP Eagle head, one safetensors file; default) or "
        "eagle3 (an EAGLE-3 checkpoint directory, LlamaForCausalLMEagle3, that SGLang, vLLM and SpecForge load, "
        "served here with --spec-method eagle3)",
    )
    g.add_argument(
        "--out",
        help="exported head (default: speculative/heads/smollm2-135m-mtp.safetensors for "
        "the default target, else ./mtp-head.safetensors; with --format eagle3, ./eagle3-head/)",
    )
    g.add_argument("--model-card", help="model card path (default: MODEL_CARD.md beside --out)")
    g.add_argument("--results", help="results JSON (default: <out stem>.results.json beside --out)")
    g.add_argument("--head", help="--stage eval: head to score (default: --out); --stage vocab: head to restrict")
    g.add_argument(
        "--draft-vocab",
        type=pos_int,
        default=d.draft_vocab,
        help="--stage vocab: rows of the reduced draft lm_head (default %(default)s)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--data-dir", help="dataset folder (default: $MTPSERVE_CACHE/draft-data/<target>)")
    g.add_argument("--rebuild-data", action="store_true", help="delete the folder's parts and build them anew")
    g.add_argument(
        "--mix",
        type=_mix,
        default=_mix(str(DEFAULTS["mix"])),
        help=f"parts per recipe, e.g. chat=12,code=6 (recipes: {', '.join(RECIPE_NAMES)}; default {DEFAULTS['mix']})",
    )
    g.add_argument("--part-size", type=pos_int, default=d.part_size, help="samples per part (default %(default)s)")
    g.add_argument("--shard", type=_shard, default=(0, 1), help="W/N: build only parts W, W+N, ... (default 0/1)")
    g.add_argument("--max-new-tokens", type=pos_int, default=d.max_new_tokens, help="answer length cap")
    g.add_argument("--long-max-new-tokens", type=pos_int, default=d.long_max_new_tokens, help="cap of `long` answers")
    g.add_argument(
        "--code-max-new-tokens", type=pos_int, default=d.code_max_new_tokens, help="cap of `code` continuations"
    )
    g.add_argument(
        "--prompt-max-tokens", type=pos_int, default=d.prompt_max_tokens, help="cap while the target writes a user turn"
    )
    g.add_argument(
        "--oversample",
        type=_bounded(float, 1.0),
        default=d.oversample,
        help="user-turn candidates per sample kept (filters drop short/unfinished/duplicates)",
    )
    g.add_argument(
        "--sampled-fraction",
        type=_bounded(float, 0.0, 1.0),
        default=d.sampled_fraction,
        help="share of answers sampled (temperature 0.7) instead of greedy",
    )
    g.add_argument("--code-root", help="Python sources for `code` prompts (default: this interpreter's stdlib)")
    g.add_argument(
        "--generator",
        choices=["engine", "hf"],
        default="engine",
        help="engine: mtpserve's own engine, CUDA graphs on a GPU (default); hf: transformers generate, "
        "a reference (training always uses our model code)",
    )
    g.add_argument("--gen-batch-size", type=pos_int, default=64, help="concurrent generations")

    g = p.add_argument_group("training")
    g.add_argument("--steps", type=nonneg_int, default=t.steps, help="optimizer steps (default %(default)s)")
    g.add_argument("--batch-size", type=pos_int, default=t.batch_size, help="sequences per step")
    g.add_argument(
        "--max-batch-tokens",
        type=pos_int,
        help="cap on a step's padded tokens: batches of long sequences hold fewer of them (default: no cap)",
    )
    g.add_argument("--lr", type=_bounded(float, 0.0, lo_open=True), default=t.lr)
    g.add_argument("--weight-decay", type=_bounded(float, 0.0), default=t.weight_decay)
    g.add_argument("--warmup-steps", type=nonneg_int, help="default: 5%% of --steps")
    g.add_argument("--min-lr-ratio", type=_bounded(float, 0.0, 1.0), default=t.min_lr_ratio)
    g.add_argument("--grad-clip", type=_bounded(float, 0.0, lo_open=True), default=t.grad_clip)
    g.add_argument(
        "--num-draft-tokens",
        "-k",
        type=pos_int,
        default=t.num_draft_tokens,
        help="K: unrolled draft steps in training and the evaluated chain length (>= 1)",
    )
    g.add_argument("--step-weights", type=_weights, help="loss weight per unrolled step, e.g. 1,0.7,0.5")
    g.add_argument(
        "--init-from-target",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="initialise the head's layer from the target's last decoder layer (default on)",
    )
    g.add_argument(
        "--init-head",
        metavar="PATH",
        help="start every head from this trained head (same feature layers and draft vocabulary; a head with a "
        "wider mlp= starts with its extra units switched off), to continue training on new data",
    )
    g.add_argument(
        "--time-budget",
        type=_bounded(float, 0.0, lo_open=True),
        help="seconds for the whole command; steps are cut to fit, keeping time for eval/export",
    )
    g.add_argument(
        "--pause-after",
        type=pos_int,
        help="stop this run after N steps (checkpoint + export); continue later with --resume",
    )
    g.add_argument(
        "--keep-hidden",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep target features on the device between visits of a sequence (default: when they fit)",
    )
    g.add_argument(
        "--head-spec",
        action="append",
        type=_head_spec,
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a head to train (repeat for an ablation, all on the same batches): layers=last|fused|i/j/k, "
        "vocab=N (N most frequent response tokens; 0 = all), k=unrolled loss steps, mlp=N (the draft "
        "layer's MLP width; 0 = the target's), path=W (chains that greedy decoding with the head would run "
        "weigh 1+W in the loss; default 0), decoder=N (decoder layers per draft step, 1-4; default 1), "
        "repeat=W (loss weight of rows whose token repeats an 8-gram earlier in its answer; default 1), --format "
        "eagle3: lm_head=trained|frozen (its final norm, lm_head), residual=raw|normed (its layer's residual), layers="
        "eagle3 (EAGLE-3's 1, L/2-1, L-4; layers before the last, decoder=1); default one head, 'head:layers=last' "
        "(--format eagle3: 'head:layers=eagle3,lm_head=frozen,residual=normed')",
    )
    g.add_argument(
        "--prefer-margin",
        type=_bounded(float, 0.0),
        default=t.prefer_margin,
        help="ship a cheaper head (fewer decoder layers, smaller draft vocabulary, narrower MLP) within this "
        "much dev acceptance length of the best",
    )
    g.add_argument(
        "--export-dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the exported head"
    )

    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument(
        "--dev-fraction",
        type=_bounded(float, 0.0, 1.0, hi_open=True),
        default=t.dev_fraction,
        help="share of sequences held apart for dev acceptance (greedy ones)",
    )
    g.add_argument(
        "--holdout-source",
        action="append",
        choices=list(RECIPE_NAMES),
        default=[],
        help="keep every prompt of this recipe for dev (repeatable); 'seed' measures acceptance on "
        "hand-written prompts, a different distribution from the self-written ones",
    )
    g.add_argument("--eval-every", type=nonneg_int, default=t.eval_every, help="0: only at start and end")
    g.add_argument("--eval-batch-size", type=pos_int, default=t.eval_batch_size)
    g.add_argument("--ckpt-every", type=nonneg_int, default=t.ckpt_every, help="0: only at the end")
    g.add_argument("--ckpt-dir", help="checkpoint folder (default: <data-dir>/checkpoints)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --ckpt-dir")
    p.set_defaults(func=run, train_parser=p)


def command_line(args: argparse.Namespace) -> str:
    """The effective command: every flag with its value, so the run can be repeated exactly."""
    parser: argparse.ArgumentParser = args.train_parser
    parts = ["mtpserve", "train-draft"]
    for action in parser._actions:
        if not action.option_strings or action.dest in {"help"}:
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                parts.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._AppendAction):
            for v in value or []:
                parts += [flag, v.text() if hasattr(v, "text") else str(v)]
        elif action.nargs == 0:
            if value:
                parts.append(flag)
        elif value is not None:
            parts += [flag, _flag_text(value)]
    return shlex.join(parts)


def _flag_text(value: Any) -> str:
    """A flag value as the command line would spell it."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return "/".join(map(str, value))
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def options_from_args(args: argparse.Namespace) -> TrainDraftOptions:
    """Map parsed flags onto TrainDraftOptions (devices resolved, default paths filled in)."""
    from mtpserve.modeling.loader import cache_root, resolve_device
    from mtpserve.speculative.train.data import DataConfig
    from mtpserve.speculative.train.heads import default_head
    from mtpserve.speculative.train.pipeline import TrainDraftOptions
    from mtpserve.speculative.train.recipes import RecipeSettings
    from mtpserve.speculative.train.trainer import TrainConfig

    device = resolve_device(args.device)
    name = Path(args.target).stem if args.target else "smollm2-135m-instruct"
    data_dir = args.data_dir or str(cache_root() / "draft-data" / name)
    out = args.out or ("eagle3-head" if args.format == "eagle3" else None)
    if out is None and args.target is None:
        from mtpserve.workers.builders import DEFAULT_HEAD

        out = str(DEFAULT_HEAD)
    out = out or "mtp-head.safetensors"
    settings = RecipeSettings(
        max_new_tokens=args.max_new_tokens,
        long_max_new_tokens=args.long_max_new_tokens,
        code_max_new_tokens=args.code_max_new_tokens,
        prompt_max_tokens=args.prompt_max_tokens,
        oversample=args.oversample,
        sampled_fraction=args.sampled_fraction,
        code_root=args.code_root,
    )
    data = DataConfig(mix=args.mix, part_size=args.part_size, settings=settings, seed=args.seed)
    train = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        grad_clip=args.grad_clip,
        num_draft_tokens=args.num_draft_tokens,
        step_weights=args.step_weights,
        init_from_target=args.init_from_target,
        init_head=args.init_head,
        device=device,
        dtype=args.dtype,
        dev_fraction=args.dev_fraction,
        holdout_sources=tuple(args.holdout_source),
        eval_every=args.eval_every,
        eval_batch_size=args.eval_batch_size,
        ckpt_every=args.ckpt_every,
        ckpt_dir=args.ckpt_dir or str(Path(data_dir) / "checkpoints"),
        resume=args.resume,
        seed=args.seed,
        time_budget_s=args.time_budget,
        pause_after=args.pause_after,
        keep_hidden=args.keep_hidden,
        max_batch_tokens=args.max_batch_tokens,
        heads=args.head_spec or [default_head(args.format)],
        head_format=args.format,
        prefer_margin=args.prefer_margin,
    )
    return TrainDraftOptions(
        target=args.target,
        load_format=args.load_format,
        dummy_std=args.dummy_std,
        stage=args.stage,
        data_dir=data_dir,
        rebuild_data=args.rebuild_data,
        generator=args.generator,
        gen_batch_size=args.gen_batch_size,
        out=out,
        model_card=args.model_card,
        results=args.results,
        head=args.head,
        draft_vocab=args.draft_vocab,
        shard=args.shard,
        export_dtype=args.export_dtype,
        command=command_line(args),
        data=data,
        train=train,
    )


def run(args: argparse.Namespace) -> int:
    """Run train-draft; setup errors print `mtpserve: train-draft: FIELD: reason` and return 2."""
    from mtpserve.cluster.cli.train_generator import EngineGenerator
    from mtpserve.speculative.train.pipeline import run_train_draft

    if args.step_weights is not None and len(args.step_weights) != args.num_draft_tokens:
        args.train_parser.error(
            f"argument --step-weights: needs {args.num_draft_tokens} values (one per draft step), "
            f"got {len(args.step_weights)}"
        )
    try:
        opts = options_from_args(args)
        res = run_train_draft(opts, EngineGenerator)
    except TrainSetupError as exc:
        print(f"mtpserve: train-draft: {exc}", file=sys.stderr)
        return 2
    except MTPServeError as exc:
        print(f"mtpserve: train-draft: {exc}", file=sys.stderr)
        return 2
    if "dev" in res:
        dev = res["dev"]
        rates = " / ".join(f"{r:.2f}" for r in dev["per_position"])
        print(
            f"dev acceptance length {dev['first_acceptance_length']:.3f} over the first {dev['first_tokens']} "
            f"tokens, {dev['online_acceptance_length']:.3f} along the decoding path, "
            f"{dev['acceptance_length']:.3f} over every position (K={dev['num_draft_tokens']}, per position {rates})"
        )
    if opts.stage in {"all", "train"}:
        print(f"wrote {opts.out}")
    if opts.stage == "vocab":
        print(f"wrote {res['head']}: draft vocabulary {res['draft_vocab']}, {100 * res['coverage']:.2f}% of the "
              f"training responses' tokens")  # fmt: skip
    return 0
