"""Trains an MTP Eagle head by self-distillation, unrolled over K draft steps (training-time test).

Loop: batch of sequences -> target features (dense forward, kept on the device when they fit) -> for each
head: K unrolled head steps -> weighted soft cross-entropy against the target's distribution -> AdamW step
(grad clipping, linear warmup then cosine decay to `min_lr_ratio`). bf16 autocast on CUDA, plain fp32 on
CPU. Several heads (an ablation) train side by side on the same batches, sharing the target's forward.
Periodic dev-set acceptance, checkpoints (head, optimizer, scheduler, step, RNG) and `resume`.
With a time budget the number of steps is projected from measured step times so that the final
evaluation and export still fit.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mtpserve.modeling.families import model_class
from mtpserve.modeling.model import LlamaArgs, LlamaModel
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.train.batches import HiddenStore, autocast_ctx, epoch_batches
from mtpserve.speculative.train.data import TokenDataset
from mtpserve.speculative.train.errors import TrainSetupError
from mtpserve.speculative.train.eval import evaluate_heads
from mtpserve.speculative.train.heads import (
    HeadSpec,
    check_specs,
    choose_head,
    frequent_vocab,
    load_init_head,
    new_head,
    response_token_counts,
)
from mtpserve.speculative.train.loss import default_step_weights, target_rows, unrolled_loss
from mtpserve.speculative.train.schedule import lr_factor, next_replan

log = logging.getLogger(__name__)
CKPT_NAME = "latest.pt"


@dataclass
class TrainConfig:
    """Optimisation, unrolling, evaluation and checkpoint settings."""

    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: 5% of steps (at least 1)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    num_draft_tokens: int = 3  # K, unroll depth and evaluation chain length
    step_weights: list[float] | None = None  # None: 1, 0.7, 0.49, ...
    init_from_target: bool = True
    init_head: str | None = None  # start every head from this trained head's weights (a continued training)
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    dev_fraction: float = 0.05
    holdout_sources: tuple[str, ...] = ()  # prompt sources kept entirely for dev (e.g. ("seed",))
    eval_every: int = 200  # 0: only at start and end
    eval_batch_size: int = 16
    ckpt_every: int = 200  # 0: only at the end
    ckpt_dir: str | None = None
    resume: bool = False
    seed: int = 0
    time_budget_s: float | None = None  # wall-clock budget from `start_time` (whole run)
    pause_after: int | None = None  # stop this run after so many steps (checkpoint; continue with resume)
    start_time: float = field(default_factory=time.time)
    keep_hidden: bool | None = None  # None: keep target features on the device when they fit
    max_batch_tokens: int | None = None  # cap on a batch's padded tokens (None: only batch_size counts)
    log_every: int = 10
    heads: list[HeadSpec] = field(default_factory=lambda: [HeadSpec()])  # trained side by side on the same batches
    head_format: str = "mtp"  # the heads' layout: 'mtp' (MTP Eagle) or 'eagle3' (`heads.HEAD_FORMATS`)
    prefer_margin: float = 0.01  # a head within this much dev acceptance length of the best wins if smaller

    def weights(self) -> list[float]:
        """Per-step loss weights, K of them."""
        w = self.step_weights or default_step_weights(self.num_draft_tokens)
        if len(w) != self.num_draft_tokens:
            raise TrainSetupError("--step-weights", f"needs {self.num_draft_tokens} values, got {len(w)}")
        return list(w)

    def compute_dtype(self) -> torch.dtype:
        """Autocast dtype (fp32 on CPU whatever `dtype` says is 'auto')."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def build_shared(args: LlamaArgs, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> LlamaModel:
    """The frozen target (embedding, layers, final norm, lm_head) for hidden states and the shared head."""
    model = model_class(args)(args)
    model.load_hf_state_dict(weights)
    model = model.to(device=device, dtype=dtype).eval()
    return model.requires_grad_(False)


@dataclass
class HeadRun:
    """One head being trained: its spec, module, optimizer, schedule and latest metrics."""

    spec: HeadSpec
    head: DraftHead
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    weights: list[float]
    vocab_coverage: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Owns the frozen target, the heads, their optimizers and the data order."""

    def __init__(self, cfg: TrainConfig, args: LlamaArgs, weights: dict[str, torch.Tensor], data: TokenDataset) -> None:
        if cfg.num_draft_tokens < 1:
            raise TrainSetupError("--num-draft-tokens", f"must be >= 1, got {cfg.num_draft_tokens}")
        check_specs(cfg.heads, args, cfg.num_draft_tokens, cfg.head_format)
        self.cfg = cfg
        self.args = args
        self.data = data
        self.device = torch.device(cfg.device)
        self.dtype = cfg.compute_dtype()
        self.step_weights = cfg.weights()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        target_dtype = self.dtype if self.device.type == "cuda" else torch.float32
        self.shared = build_shared(args, weights, cfg.device, target_dtype)
        self.train_idx, self.dev_idx = data.split(cfg.dev_fraction, cfg.seed, cfg.holdout_sources)
        if not self.train_idx:
            raise TrainSetupError("--data-dir", "no training sequences left after the dev split")
        self.total_steps = cfg.steps
        self.warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
        source = load_init_head(cfg.init_head, args) if cfg.init_head else None
        self.runs = [self._build_run(spec, weights, source) for spec in cfg.heads]
        layers = tuple(sorted({i for r in self.runs for i in r.head.feature_layers}))
        keep = cfg.keep_hidden if cfg.keep_hidden is not None else self._features_fit(len(layers))
        self.store = HiddenStore(self.shared, data, self.device, keep=keep, layers=layers)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.dev_initial: dict[str, Any] | None = None
        self.train_wall_s = 0.0
        self.tokens_seen = 0
        self.stopped_by = "steps"
        self.resumed_from: int | None = None
        self.lengths = data.lengths()
        self._epochs: dict[int, list[list[int]]] = {}

    def _build_run(self, spec: HeadSpec, weights: dict[str, torch.Tensor], source: DraftHead | None) -> HeadRun:
        cfg = self.cfg
        vocab_ids, coverage = None, None
        if spec.draft_vocab:
            counts = response_token_counts(self.data, self.train_idx, self.args.vocab_size)
            vocab_ids, coverage = frequent_vocab(counts, spec.draft_vocab)
        head = new_head(cfg.head_format, self.args, spec, vocab_ids)
        if source is not None:
            try:
                head.init_from_head(source)
            except ValueError as exc:
                raise TrainSetupError("--init-head", f"{spec.name}: {exc}") from None
        elif cfg.init_from_target:
            head.init_from_target(weights)
        else:
            head.init_random(seed=cfg.seed)
        head.to(self.device).train()
        trainable = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, self.warmup, self.total_steps, cfg.min_lr_ratio)
        )
        k = spec.num_draft_tokens or cfg.num_draft_tokens
        return HeadRun(spec, head, opt, sched, weights=self.step_weights[:k], vocab_coverage=coverage)

    def _init_text(self) -> str:
        cfg = self.cfg
        if cfg.init_head:
            return f"the trained head {Path(cfg.init_head).name}"
        return "target's last decoder layer" if cfg.init_from_target else f"random (seed {cfg.seed})"

    def _features_fit(self, num_layers: int) -> bool:
        """Whether every sequence's target features fit in a third of the free device memory (always on CPU)."""
        if self.device.type != "cuda":
            return True
        per_token = num_layers * self.args.hidden_size * torch.finfo(self.dtype).bits // 8
        free, _ = torch.cuda.mem_get_info(self.device)
        return sum(self.data.lengths()) * per_token < free / 3

    @property
    def head(self) -> DraftHead:
        """The first head (the only one in a plain run)."""
        return self.runs[0].head

    @property
    def last_metrics(self) -> dict[str, float]:
        """The first head's latest training metrics."""
        return self.runs[0].metrics

    # ---- data order ------------------------------------------------------------------------------
    def batch_indices(self, step: int) -> list[int]:
        """Sequences of global step `step` (a pure function of seed and step, so resume is exact)."""
        epoch, i = 0, step
        while True:
            batches = self._epoch_batches(epoch)
            if i < len(batches):
                return batches[i]
            epoch, i = epoch + 1, i - len(batches)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            cfg = self.cfg
            self._epochs[epoch] = epoch_batches(
                self.train_idx, self.lengths, cfg.batch_size, cfg.seed, epoch=epoch, max_tokens=cfg.max_batch_tokens
            )
        return self._epochs[epoch]

    # ---- checkpoints -----------------------------------------------------------------------------
    def ckpt_path(self) -> Path | None:
        """Where the rolling checkpoint lives (None when checkpoints are off)."""
        return Path(self.cfg.ckpt_dir) / CKPT_NAME if self.cfg.ckpt_dir else None

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "sequences": len(self.data),
            "tokens": sum(self.lengths),
            "hidden_size": self.args.hidden_size,
            "num_draft_tokens": self.cfg.num_draft_tokens,
            "dev": len(self.dev_idx),
            "heads": [asdict(r.spec) for r in self.runs],
        }

    def save_checkpoint(self) -> Path | None:
        """Atomically write every head with its optimizer and scheduler, the step, RNG and history."""
        path = self.ckpt_path()
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "heads": {
                r.spec.name: {
                    "head": r.head.state_dict(),
                    "optimizer": r.opt.state_dict(),
                    "scheduler": r.sched.state_dict(),
                }
                for r in self.runs
            },
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python": random.getstate(),
            },
            "history": self.history,
            "dev_initial": self.dev_initial,
            "train_wall_s": self.train_wall_s,
            "tokens_seen": self.tokens_seen,
            "fingerprint": self._fingerprint(),
            "config": {k: v for k, v in asdict(self.cfg).items() if k != "start_time"},
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self) -> int:
        """Restore the rolling checkpoint; returns the step it was saved at."""
        path = self.ckpt_path()
        if path is None or not path.is_file():
            raise TrainSetupError("--resume", f"no checkpoint at '{path}'; run once without --resume first")
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["fingerprint"] != self._fingerprint():
            raise TrainSetupError(
                "--resume", f"checkpoint {path} was made for {state['fingerprint']}, not {self._fingerprint()}"
            )
        for r in self.runs:
            saved = state["heads"][r.spec.name]
            r.head.load_state_dict(saved["head"])
            r.opt.load_state_dict(saved["optimizer"])
            r.sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        self.history = list(state["history"])
        self.dev_initial = state["dev_initial"]
        self.train_wall_s = float(state["train_wall_s"])
        self.tokens_seen = int(state["tokens_seen"])
        return self.step

    # ---- evaluation ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, dict[str, Any]]:
        """Dev-set acceptance of every head (K-chain, teacher-forced), by head name."""
        return evaluate_heads(
            {r.spec.name: r.head for r in self.runs},
            self.shared,
            self.store,
            self.dev_idx,
            k=self.cfg.num_draft_tokens,
            batch_size=self.cfg.eval_batch_size,
            dtype=self.dtype,
        )

    def best(self, dev: dict[str, dict[str, Any]]) -> str:
        """The head to ship, by dev acceptance over the answers' first tokens (`heads.choose_head`)."""
        score = {name: d["first_acceptance_length"] for name, d in dev.items()}
        return choose_head(score, {r.spec.name: r.head for r in self.runs}, self.cfg.prefer_margin)

    # ---- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimisation step of every head on the batch of the current global step; returns the
        first head's metrics (every head's are in its HeadRun)."""
        batch = self.store.batch(self.batch_indices(self.step))
        with autocast_ctx(self.device, self.dtype):
            rows = target_rows(self.shared, batch, repeats=any(r.spec.repeat != 1.0 for r in self.runs))
            for r in self.runs:
                spec = r.spec
                loss, metrics = unrolled_loss(
                    r.head, self.shared, batch, r.weights, rows=rows, path_weight=spec.path, repeat_weight=spec.repeat
                )
                r.opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(r.head.parameters(), self.cfg.grad_clip)
                r.opt.step()
                r.sched.step()
                metrics["grad_norm"] = float(norm)
                metrics["lr"] = float(r.sched.get_last_lr()[0])
                r.metrics = metrics
        self.step += 1
        self.tokens_seen += int(batch.lengths.sum())
        return self.runs[0].metrics

    def _remaining_s(self) -> float:
        if self.cfg.time_budget_s is None:
            return math.inf
        return self.cfg.start_time + self.cfg.time_budget_s - time.time()

    def _reserve_s(self, eval_s: float) -> float:
        """Seconds kept for the final evaluation, checkpoint and export."""
        return 1.5 * eval_s + 2.0 + 0.02 * (self.cfg.time_budget_s or 0.0)

    def _plan_steps(self, step_s: float, eval_s: float, requested: int) -> None:
        """Size total_steps (at most `requested`) so training, periodic evals, the final eval and export fit
        the budget. Called again as the measured step time settles; the first steps are often slow."""
        remaining = self._remaining_s() - self._reserve_s(eval_s)
        per_step = step_s + (eval_s / self.cfg.eval_every if self.cfg.eval_every else 0.0)
        fit = min(requested, self.step + max(1, int(remaining / per_step)))
        if fit != self.total_steps:
            log.info("time budget: %d steps fit (%.4f s/step; %d requested)", fit, step_s, requested)
            self.total_steps = fit
            self.stopped_by = "time budget" if fit < requested else "steps"
            if self.cfg.warmup_steps is None and self.step < self.warmup:  # default warmup: 5% of the steps run
                self.warmup = max(self.step + 1, min(self.warmup, fit // 20))

    def _dev_line(self, dev: dict[str, dict[str, Any]]) -> str:
        return "; ".join(
            f"{name} {res['first_acceptance_length']:.3f} (decoding path {res['online_acceptance_length']:.3f}, "
            f"every position {res['acceptance_length']:.3f} "
            f"{[round(x, 3) for x in res['per_position']]})"
            for name, res in dev.items()
        )

    def run(self) -> dict[str, Any]:
        """Train (or resume) to `total_steps`; returns the results dict (history, dev acceptance, timings)."""
        resumed = self.load_checkpoint() if self.cfg.resume else None
        self.resumed_from = resumed
        stop_at = self.total_steps if self.cfg.pause_after is None else self.step + self.cfg.pause_after
        self.store.precompute(self.train_idx + self.dev_idx)
        t_eval = time.perf_counter()
        first = self.evaluate()
        eval_s = time.perf_counter() - t_eval
        if resumed is None:
            self.dev_initial = first
            self.history.append({"step": 0, "dev": first})
        log.info("dev acceptance at step %d: %s", self.step, self._dev_line(first))
        t0 = time.perf_counter()
        requested = self.total_steps
        run_start = self.step  # a resumed run plans from its own first steps, which are slow while warming up
        window_step, next_plan = self.step + 3, self.step + 23  # re-planned 23, 92, 368, ... steps into this run
        window_t = None
        with tqdm(total=self.total_steps, initial=self.step, desc="train-draft", unit="step") as bar:
            while self.step < self.total_steps:
                if self.step >= stop_at:
                    self.stopped_by = f"paused after {self.cfg.pause_after} steps"
                    break
                if self._remaining_s() < self._reserve_s(eval_s):
                    self.stopped_by = "time budget"
                    break
                m = self.train_step()
                bar.update(1)
                if self.step == window_step:
                    window_t = time.perf_counter()
                budgeted = self.cfg.time_budget_s is not None
                if budgeted and window_t is not None and self.step == next_plan:
                    now = time.perf_counter()
                    self._plan_steps((now - window_t) / (self.step - window_step), eval_s, requested)
                    bar.total = self.total_steps
                    window_step, window_t, next_plan = self.step, now, next_replan(self.step, run_start)
                if self.step % self.cfg.log_every == 0 or self.step == self.total_steps:
                    shown = {"loss": f"{m.get('loss', float('nan')):.3f}", "acc1": f"{m.get('acc1', 0):.2f}"}
                    shown["lr"] = f"{m['lr']:.2e}"
                    bar.set_postfix(shown)
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.total_steps:
                    t_eval = time.perf_counter()
                    res = self.evaluate()
                    eval_s = time.perf_counter() - t_eval
                    self.history.append({"step": self.step, "loss": self._losses(), "dev": res})
                    bar.write(f"step {self.step}: dev acceptance length {self._dev_line(res)}")
                if self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0:
                    self.save_checkpoint()
        self.train_wall_s += time.perf_counter() - t0
        final = self.evaluate()
        self.history.append({"step": self.step, "loss": self._losses(), "dev": final})
        self.save_checkpoint()
        return self.results(final)

    def _losses(self) -> dict[str, float | None]:
        return {r.spec.name: r.metrics.get("loss") for r in self.runs}

    def results(self, final: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Everything worth recording about this run; `dev` is the chosen head's final dev acceptance."""
        cfg = self.cfg
        best = self.best(final)
        initial = self.dev_initial or {}
        heads = {
            r.spec.name: {
                "spec": asdict(r.spec),
                "description": r.spec.describe(self.args, cfg.num_draft_tokens),
                "feature_layers": list(r.head.feature_layers),
                "draft_vocab": r.head.draft_vocab_size,
                "draft_vocab_coverage": r.vocab_coverage,
                "loss_steps": len(r.weights),
                "dev": final[r.spec.name],
                "dev_initial": initial.get(r.spec.name),
                "final_metrics": r.metrics,
                "params": sum(p.numel() for p in r.head.parameters()),
            }
            for r in self.runs
        }
        return {
            "best": best,
            "dev": final[best],
            "dev_initial": initial.get(best),
            "heads": heads,
            "history": self.history,
            "train": {
                "steps": self.step,
                "planned_steps": cfg.steps,
                "stopped_by": self.stopped_by,
                "resumed_from": self.resumed_from,
                "schedule_steps": self.total_steps,
                "batch_size": cfg.batch_size,
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
                "warmup_steps": self.warmup,
                "min_lr_ratio": cfg.min_lr_ratio,
                "grad_clip": cfg.grad_clip,
                "num_draft_tokens": cfg.num_draft_tokens,
                "step_weights": self.step_weights,
                "init": self._init_text(),
                "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device),
                "holdout_sources": list(cfg.holdout_sources),
                "train_sequences": len(self.train_idx),
                "dev_sequences": len(self.dev_idx),
                "tokens_seen": self.tokens_seen,
                "final_loss": self.last_metrics.get("loss"),
                "final_metrics": self.last_metrics,
                "wall_time_s": round(self.train_wall_s, 2),
                "features_kept_on_device": self.store.keep,
                "seed": cfg.seed,
            },
        }

    def export(
        self, path: str | Path, metadata: dict[str, Any], name: str | None = None, dtype: torch.dtype = torch.float32
    ) -> Path:
        """Save a head (the named one, else the first) in its layout's file format, with string metadata."""
        run = next((r for r in self.runs if r.spec.name == name), self.runs[0])
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        run.head.save(p, {k: v if isinstance(v, str) else str(v) for k, v in metadata.items()}, dtype)
        return p
