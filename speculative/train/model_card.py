"""The model card written next to an exported draft head (how it was made, and how well it drafts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpserve.speculative.train.eval import FIRST_TOKENS

LAYOUTS = {  # what the head is, by train-draft's --format
    "mtp": [
        "An MTP Eagle draft head (DeepSeek-V3 MTP layout: enorm/hnorm, eh_proj, one decoder layer; the target's",
        "embedding, final norm and lm_head are shared and not stored),",
    ],
    "eagle3": [
        "An EAGLE-3 draft head (`LlamaForCausalLMEagle3` checkpoint directory: fc over the target's feature layers,",
        "one decoder layer over [normed embedding | normed hidden], its own norm, lm_head and d2t/t2d vocabulary",
        "map; the target's embedding is shared and not stored; SGLang, vLLM and SpecForge load it),",
    ],
}


def _fmt_rates(rates: list[float]) -> str:
    return " / ".join(f"{r:.2f}" for r in rates)


def _acceptance_rows(name: str, res: dict[str, Any] | None) -> list[str]:
    if not res:
        return []
    rows = [_acceptance_row(name, res)]
    rows += [_acceptance_row(f"{name}, {src} prompts", sub) for src, sub in res.get("by_source", {}).items()]
    return rows


def _acceptance_row(label: str, res: dict[str, Any]) -> str:
    return (
        f"| {label} | {res['first_acceptance_length']:.3f} | {res['online_acceptance_length']:.3f} | "
        f"{res['acceptance_length']:.3f} | "
        f"{_fmt_rates(res['per_position'])} | {_fmt_rates(res.get('conditional_per_position', []))} | "
        f"{res['sequences']} | {res['bases']} |"
    )


def _first(info: dict[str, Any]) -> int:
    """The window of the first-tokens figure in these results."""
    return int((info.get("dev") or {}).get("first_tokens", FIRST_TOKENS))


def _initial_label(train: dict[str, Any]) -> str:
    """Row label of the heads before their first step: untrained, or the trained head they continue."""
    init = str(train.get("init", ""))
    return "initial (the head continued)" if init.startswith("the trained head") else "untrained (initial)"


def _ablation_section(info: dict[str, Any]) -> list[str]:
    """One row per head trained side by side (same data, batches, steps and optimiser settings)."""
    heads = info.get("heads") or {}
    if len(heads) < 2:
        return []
    sources = sorted({s for h in heads.values() for s in h["dev"].get("by_source", {})})
    lines = [
        "## Ablation: heads trained side by side on the same batches",
        "",
        f"Shipped: **{info.get('best')}** (best dev acceptance length over the first {_first(info)} tokens; a "
        "cheaper head, "
        "with fewer decoder layers, a smaller draft vocabulary or a narrower MLP, wins within "
        f"{info.get('prefer_margin', 0.01)}).",
        "",
        f"| head | what | params | draft vocab (coverage) | dev AL, first {_first(info)} tokens | dev AL, decoding "
        "path | dev AL, every position | per position | "
        + " | ".join(f"AL {s}, first {_first(info)}" for s in sources)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(sources),
    ]
    for name, h in heads.items():
        dev = h["dev"]
        cov = h.get("draft_vocab_coverage")
        vocab = f"{h['draft_vocab']}" + (f" ({100 * cov:.2f}%)" if cov is not None else "")
        by = dev.get("by_source", {})
        cells = [f"{by[s]['first_acceptance_length']:.3f}" if s in by else "-" for s in sources]
        lines.append(
            f"| {name} | {h['description']} | {h['params'] / 1e6:.2f}M | {vocab} | "
            f"{dev['first_acceptance_length']:.3f} | {dev['online_acceptance_length']:.3f} | "
            f"{dev['acceptance_length']:.3f} | {_fmt_rates(dev['per_position'])} | " + " | ".join(cells) + " |"
        )
    return [*lines, ""]


def render_model_card(info: dict[str, Any]) -> str:
    """Markdown for `info` (keys: head, target, data, train, dev, dev_initial, command, hardware, ...)."""
    data = info.get("data", {})
    counts = data.get("counts", {})
    train = info.get("train", {})
    k = (info.get("dev") or {}).get("num_draft_tokens", train.get("num_draft_tokens", "?"))
    lines = [
        f"# Draft head: {info.get('head', 'MTP Eagle head')}",
        "",
        *LAYOUTS[info.get("format", "mtp")],
        "trained by `mtpserve train-draft` by self-distillation on the target's own outputs. No dataset was",
        "downloaded.",
        "",
        "## Target",
        f"- model: `{info.get('target', '?')}`",
        f"- architecture: {info.get('target_shape', '?')}",
        "",
        "## Data",
        f"- sequences: {counts.get('sequences', '?')} ({counts.get('tokens', '?')} tokens, "
        f"{counts.get('response_tokens', '?')} response tokens)",
        f"- prompts by source: {counts.get('by_source', {})} (seed = built-in list, magpie = written by the "
        "target from its bare user header, steered = written by the target after a built-in "
        "opener, random = random token ids for tokenizer-less targets)",
        f"- responses: {counts.get('greedy', '?')} greedy, {counts.get('sampled', '?')} sampled; "
        f"generator: {data.get('generator', '?')}",
        f"- train / dev split: {train.get('train_sequences', '?')} / {train.get('dev_sequences', '?')} sequences "
        "(dev prompts are held apart; dev responses are greedy)",
        "- hidden states: recomputed at train time by a dense target forward (only token ids are stored)",
        "",
        "## Training",
        f"- steps: {train.get('steps', '?')} at batch {train.get('batch_size', '?')} sequences, "
        f"lr {train.get('lr', '?')} (AdamW, warmup {train.get('warmup_steps', '?')} + cosine), "
        f"grad clip {train.get('grad_clip', '?')}",
        f"- unrolled draft steps (training-time test): {train.get('num_draft_tokens', '?')}, "
        f"loss weights {[round(w, 3) for w in train.get('step_weights', [])]}",
        "- loss: soft cross-entropy against the target's next-token distribution; final loss "
        + (f"{train['final_loss']:.4f}" if isinstance(train.get("final_loss"), float) else "?"),
        f"- initialisation: {train.get('init', '?')}",
        f"- wall time: {train.get('wall_time_s', '?')} s training, {info.get('total_wall_s', '?')} s in all",
        f"- hardware: {info.get('hardware', '?')}; dtype {train.get('dtype', '?')}",
        "",
        f"## Dev-set acceptance (greedy, K={k} chain, teacher-forced)",
        "",
        f"| head | AL, first {_first(info)} tokens | AL, decoding path | AL, every position | per-position rate "
        "(cumulative) | conditional | sequences | chains |",
        "|---|---|---|---|---|---|---|---|",
        *_acceptance_rows(_initial_label(train), info.get("dev_initial")),
        *_acceptance_rows("trained", info.get("dev")),
        "",
        "Acceptance length = 1 + mean accepted drafts per chain. *Every position* scores a chain from each",
        "response position (the cumulative rate at position k is the share of those chains whose first k drafts",
        "were all accepted). *Decoding path* scores only the chains greedy decoding runs (each starts one past",
        "the drafts the previous one accepted): the figure the engine reports online for these responses.",
        f"*First {_first(info)} tokens* is the decoding path over the first {_first(info)} tokens of each answer, what",
        f"`mtpserve bench acceptance --max-tokens {_first(info)}` measures; long greedy answers of a small target fall",
        "into repeated text, which is easy to draft, so the figure over whole answers reads higher.",
        "",
        *_ablation_section(info),
        "## Command",
        "",
        "```",
        str(info.get("command", "?")),
        "```",
        "",
    ]
    data_cmd = data.get("settings", {}).get("extra", {}).get("command")
    if data_cmd and data_cmd != info.get("command"):
        lines += ["The dataset was built earlier by:", "", "```", str(data_cmd), "```", ""]
    if info.get("notes"):
        lines += ["## Notes", "", str(info["notes"]), ""]
    return "\n".join(lines)


def write_model_card(path: str | Path, info: dict[str, Any]) -> Path:
    """Write the markdown model card for `info` to `path`; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_model_card(info))
    return p
