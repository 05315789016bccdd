"""Draft heads to train side by side: their specs (the choices an ablation varies) and how they are built.

A spec reads `name:key=value,...` on the command line, e.g. `fused-v16k:layers=fused,vocab=16384,k=3`:
- layers: `last` (the target's last layer only, the plain MTP input), `fused` (low / middle / last layers),
  `eagle3` (EAGLE-3's common default, layers 1, L/2-1 and L-4) or explicit 0-based layer indices joined by
  `/` (ascending; an MTP head's end at the last layer, an EAGLE-3 head's stop before it);
- vocab: 0 for the target's whole vocabulary, else the N most frequent response tokens of the training split;
- k: unrolled steps in the loss (training-time test); 1 trains only the first draft position;
- mlp: the draft layer's MLP width (0: the target's); wider units start with no effect on the output;
- path: extra loss weight on the chains greedy decoding with the head would run (0: every chain alike;
  1: those count twice), since those are the only chains whose acceptance users see;
- decoder: decoder layers per draft step (default 1); layers added to a head started from a shallower one
  begin with no effect on the output;
- repeat: loss weight of rows whose token repeats an 8-gram earlier in its answer (default 1; below 1 the
  head spends less of itself on the loops long greedy answers fall into).

A run trains heads of one layout (`--format`): `mtp` (this project's MTP Eagle head, one safetensors file) or
`eagle3` (an EAGLE-3 checkpoint directory that SGLang, vLLM and SpecForge load; one decoder layer of the
target's MLP width, three or more feature layers before the last).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative import eagle3_config
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.eagle3_head import Eagle3Head
from mtpserve.speculative.mtp_head import (
    MAX_LAYERS,
    MTPEagleHead,
    check_feature_layers,
    default_feature_layers,
    fused_feature_layers,
)
from mtpserve.speculative.train.data import TokenDataset
from mtpserve.speculative.train.errors import TrainSetupError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
HEAD_FORMATS = ("mtp", "eagle3")
CHOICES = {"lm_head": ("trained", "frozen"), "residual": ("raw", "normed")}  # EAGLE-3 keys, default first


@dataclass
class HeadSpec:
    """One head to train: its name and the choices an ablation varies."""

    name: str = "head"
    layers: str = "last"  # 'last', 'fused', 'eagle3' or '2/15/29'
    draft_vocab: int = 0  # 0: the target's whole vocabulary
    num_draft_tokens: int | None = None  # unrolled loss steps; None: the run's --num-draft-tokens
    mlp: int = 0  # the draft layer's MLP width; 0: the target's intermediate size
    path: float = 0.0  # extra loss weight on the decoding path's chains
    decoder: int = 1  # decoder layers per draft step
    repeat: float = 1.0  # loss weight of rows predicting a repeated 8-gram's token
    lm_head: str = "trained"  # an EAGLE-3 head's final norm and lm_head: 'trained', or 'frozen' as they start
    residual: str = "raw"  # an EAGLE-3 layer's residual: the hidden input ('raw') or it normed ('normed')

    def feature_layers(self, args: LlamaArgs) -> tuple[int, ...]:
        """The target layers this head reads."""
        if self.layers == "last":
            return default_feature_layers(args)
        if self.layers == "fused":
            return fused_feature_layers(args)
        if self.layers == "eagle3":
            return eagle3_config.default_feature_layers(args.num_hidden_layers)
        try:
            return tuple(int(x) for x in self.layers.split("/"))
        except ValueError:
            raise TrainSetupError("--head-spec", f"{self.name}: layers must be last, fused, eagle3 or i/j/k") from None

    def text(self) -> str:
        """The spec as `--head-spec` reads it."""
        k = f",k={self.num_draft_tokens}" if self.num_draft_tokens is not None else ""
        mlp = f",mlp={self.mlp}" if self.mlp else ""
        path = f",path={self.path:g}" if self.path else ""
        decoder = f",decoder={self.decoder}" if self.decoder != 1 else ""
        repeat = f",repeat={self.repeat:g}" if self.repeat != 1.0 else ""
        chosen = asdict(self)
        eagle3 = "".join(f",{key}={chosen[key]}" for key, v in CHOICES.items() if chosen[key] != v[0])
        return f"{self.name}:layers={self.layers},vocab={self.draft_vocab}{k}{mlp}{path}{decoder}{repeat}{eagle3}"

    def describe(self, args: LlamaArgs, k: int) -> str:
        """A short human description, for tables."""
        layers = self.feature_layers(args)
        feat = "last layer" if len(layers) == 1 else "fused layers " + "/".join(map(str, layers))
        vocab = "full vocab" if not self.draft_vocab else f"vocab {self.draft_vocab}"
        mlp = f", MLP {self.mlp}" if self.mlp else ""
        path = f", decoding-path chains x{1 + self.path:g}" if self.path else ""
        decoder = f", {self.decoder} decoder layers" if self.decoder != 1 else ""
        repeat = f", repeated 8-grams x{self.repeat:g}" if self.repeat != 1.0 else ""
        eagle3 = ", frozen norm and lm_head" if self.lm_head == "frozen" else ""
        eagle3 += ", normed residual" if self.residual == "normed" else ""
        steps = f"loss over {self.num_draft_tokens or k} step(s)"
        return f"{feat}, {vocab}{mlp}{decoder}{eagle3}, {steps}{path}{repeat}"


def default_head(head_format: str) -> HeadSpec:
    """The head a run trains when no spec is given: an MTP head reading the last layer, or for `eagle3`
    the choices that accepted most on the GPU (frozen final norm and lm_head, normed residual;
    `speculative/train/GPU_RUN.md`)."""
    if head_format == "eagle3":
        return HeadSpec(layers="eagle3", lm_head="frozen", residual="normed")
    return HeadSpec(layers="last")


def parse_head_spec(text: str) -> HeadSpec:
    """`name:layers=fused,vocab=16384,k=3` -> HeadSpec; raises TrainSetupError naming --head-spec."""
    name, _, rest = text.partition(":")
    if not _NAME.match(name):
        raise TrainSetupError("--head-spec", f"'{text}': the name must be letters, digits, '-', '_' or '.'")
    spec = HeadSpec(name=name)
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise TrainSetupError("--head-spec", f"'{text}': '{item}' is not key=value")
        if key not in ("layers", "vocab", "k", "mlp", "path", "decoder", "repeat", *CHOICES):
            known = "layers, vocab, k, mlp, path, decoder, repeat, " + ", ".join(CHOICES)
            raise TrainSetupError("--head-spec", f"'{text}': unknown key '{key}' ({known})")
        if key in CHOICES:
            if value not in CHOICES[key]:
                allowed = " or ".join(CHOICES[key])
                raise TrainSetupError("--head-spec", f"'{text}': {key} must be {allowed}, got '{value}'")
            setattr(spec, key, value)
            continue
        if key in ("path", "repeat"):
            setattr(spec, key, _weight(text, key, value))
            continue
        try:
            if key == "layers":
                spec.layers = value
            elif key == "vocab":
                spec.draft_vocab = int(value)
            elif key == "mlp":
                spec.mlp = int(value)
            elif key == "decoder":
                spec.decoder = int(value)
            else:
                spec.num_draft_tokens = int(value)
        except ValueError:
            raise TrainSetupError("--head-spec", f"'{text}': {key} must be an integer, got '{value}'") from None
    if spec.draft_vocab < 0 or spec.mlp < 0 or (spec.num_draft_tokens is not None and spec.num_draft_tokens < 1):
        raise TrainSetupError("--head-spec", f"'{text}': vocab and mlp must be >= 0 and k >= 1")
    if not 1 <= spec.decoder <= MAX_LAYERS:
        raise TrainSetupError("--head-spec", f"'{text}': decoder must be in [1, {MAX_LAYERS}], got {spec.decoder}")
    return spec


def _weight(text: str, key: str, value: str) -> float:
    try:
        w = float(value)
    except ValueError:
        raise TrainSetupError("--head-spec", f"'{text}': {key} must be a number, got '{value}'") from None
    if not 0.0 <= w <= 100.0:
        raise TrainSetupError("--head-spec", f"'{text}': {key} must be in [0, 100], got {w:g}")
    return w


def check_specs(specs: Sequence[HeadSpec], args: LlamaArgs, k: int, head_format: str = "mtp") -> None:
    """Raise TrainSetupError for duplicate names, bad layers, vocabularies larger than the target's, k > K, and
    what the EAGLE-3 layout cannot hold."""
    if head_format not in HEAD_FORMATS:
        raise TrainSetupError("--format", f"'{head_format}' is not one of {', '.join(HEAD_FORMATS)}")
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise TrainSetupError("--head-spec", f"heads need distinct names, got {names}")
    for s in specs:
        try:
            if head_format == "eagle3":
                check_eagle3_spec(s, args)
            else:
                check_feature_layers(s.feature_layers(args), args)
        except ValueError as exc:
            raise TrainSetupError("--head-spec", f"{s.name}: {exc}") from None
        chosen = asdict(s)
        for key, values in CHOICES.items():
            if chosen[key] != values[0] and head_format != "eagle3":
                why = "only an EAGLE-3 head (--format eagle3) has it; this layout scores with the target's lm_head"
                raise TrainSetupError("--head-spec", f"{s.name}: {key}={chosen[key]}: {why}")
        if s.draft_vocab > args.vocab_size:
            raise TrainSetupError("--head-spec", f"{s.name}: vocab {s.draft_vocab} > the target's {args.vocab_size}")
        if s.mlp and s.mlp < args.intermediate_size:
            raise TrainSetupError("--head-spec", f"{s.name}: mlp {s.mlp} < the target's {args.intermediate_size}")
        if (s.num_draft_tokens or k) > k:
            raise TrainSetupError("--head-spec", f"{s.name}: k {s.num_draft_tokens} > --num-draft-tokens {k}")


def check_eagle3_spec(spec: HeadSpec, args: LlamaArgs) -> None:
    """ValueError unless `spec` fits the EAGLE-3 layout: one decoder layer of the target's MLP width, and two or
    more feature layers before the last (SGLang and vLLM capture a layer's input, so the last layer's output is
    out of their reach)."""
    if spec.decoder != 1 or spec.mlp:
        raise ValueError("an EAGLE-3 head has one decoder layer of the target's MLP width (decoder=1, no mlp=)")
    n = args.num_hidden_layers
    field = f"layers (an EAGLE-3 head's stop before the last, {n - 1})"
    eagle3_config.check_feature_layers(spec.feature_layers(args), n - 1, field)


def new_head(head_format: str, args: LlamaArgs, spec: HeadSpec, vocab_ids: torch.Tensor | None) -> DraftHead:
    """An untrained head of `spec` in the run's layout."""
    layers = spec.feature_layers(args)
    if head_format == "eagle3":
        head = Eagle3Head(args, layers, vocab_ids, norm_before_residual=spec.residual == "normed")
        if spec.lm_head == "frozen":  # it scores as it starts: the target's final norm and rows, or --init-head's
            head.norm.requires_grad_(False)
            if head.lm_head is not None:
                head.lm_head.requires_grad_(False)
        return head
    return MTPEagleHead(args, layers, vocab_ids, mlp_size=spec.mlp or None, num_layers=spec.decoder)


def drafting_cost(head: DraftHead) -> tuple[int, int, int]:
    """What a head costs per draft step, most telling first: decoder layers, draft vocabulary, MLP width."""
    return (head.num_layers, head.draft_vocab_size, head.mlp_size)


def choose_head(scores: dict[str, float], heads: dict[str, DraftHead], margin: float) -> str:
    """The best-scoring head, or the cheapest (`drafting_cost`) of those within `margin` of it, since it
    drafts faster at nearly equal acceptance."""
    top = max(scores.values())
    close = [name for name, s in scores.items() if s >= top - margin]
    return min(close, key=lambda name: (*drafting_cost(heads[name]), -scores[name]))


def response_token_counts(data: TokenDataset, indices: Sequence[int], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the responses of `indices` [V] (what the draft must predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in indices:
        resp = data.ids[i][data.response_start[i] :]
        counts += torch.bincount(resp, minlength=vocab_size)[:vocab_size]
    return counts


def frequent_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent token ids (ascending; ties to the lower id) and the share of counts they cover."""
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    total = int(counts.sum())
    return ids, (int(counts[ids].sum()) / total if total else 1.0)


def load_head_file(path: str | Path, args: LlamaArgs) -> DraftHead:
    """A saved head: an EAGLE-3 checkpoint directory, or an MTP Eagle safetensors file."""
    return Eagle3Head.load(path, args) if Path(path).is_dir() else MTPEagleHead.load(path, args)


def load_init_head(path: str, args: LlamaArgs) -> DraftHead:
    """The trained head that every head of a run starts from (`--init-head`)."""
    if not Path(path).exists():
        raise TrainSetupError("--init-head", f"'{path}' does not exist")
    try:
        return load_head_file(path, args)
    except (OSError, ValueError) as exc:
        raise TrainSetupError("--init-head", str(exc)) from None
