"""Shared fixtures of the service tests: tiny model directories and an `mtpserve serve` subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SERVING_LINE = re.compile(
    r"mtpserve: serving gRPC on (?P<host>\S+):(?P<port>\d+), metrics on :(?P<metrics>\d+)"
    r"(, HTTP on (?P<http_host>\S+):(?P<http>\d+))?"
)


def tiny_config(vocab_size: int, num_layers: int = 1) -> dict[str, Any]:
    """HF config.json of a tiny Llama (hidden 64, 4 heads, 2 KV heads, 512 positions)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_dummy_model(directory: Path, vocab_size: int = 256) -> Path:
    """A config.json-only model directory for `--load-format dummy` (random weights, no tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(vocab_size, num_layers=2)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def default_tokenizer_dir() -> Path:
    """The converted default model's directory (holds SmolLM2's tokenizer and chat template)."""
    from mtpserve.modeling.loader import convert_gguf, default_gguf_path

    return convert_gguf(default_gguf_path())


def write_tiny_model(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny 1-layer random Llama in safetensors with SmolLM2's tokenizer, and a draft head for it.

    The head re-runs the target's layer on the next token (eh_proj passes only the token embedding),
    so some drafts are accepted. Returns (model directory, head path).
    """
    from tests.helpers.tiny import mimic_head, mimic_target, save_model_dir

    cfg = tiny_config(49152, num_layers=1)
    args, weights = mimic_target(
        seed, vocab_size=cfg["vocab_size"], num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2
    )
    save_model_dir(directory, args, weights)
    src = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, directory / name)
    head_path = directory / "draft.safetensors"
    mimic_head(args, weights).save(head_path)
    return directory, head_path


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: repo on PYTHONPATH, one torch thread (the CPU is shared)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.update(extra)
    return env


class ServeProcess:
    """`python -m mtpserve serve ... --port 0 --metrics-port 0` in a subprocess; parses the bound ports."""

    def __init__(self, args: list[str], startup_timeout: float = 120.0, open_files: int | None = None) -> None:
        self.open_files = open_files  # the server's limit on open files (soft and hard), when given
        self.cmd = [sys.executable, "-m", "mtpserve", "serve", "--host", "127.0.0.1", "--port", "0"]
        self.cmd += ["--metrics-port", "0", *args]
        self.startup_timeout = startup_timeout
        self.lines: list[str] = []
        self.port = 0
        self.metrics_port = 0
        self.http_port = 0
        self._ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        """host:port of the gRPC server."""
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (with --http-port)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log(self) -> str:
        """Everything the server printed so far."""
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = SERVING_LINE.search(line)
            if m:
                self.port, self.metrics_port = int(m["port"]), int(m["metrics"])
                self.http_port = int(m["http"] or 0)
                self._ready.set()
        self._ready.set()

    def start(self) -> ServeProcess:
        """Start and wait for the serving line; raises with the server's output if it does not come."""
        cmd = self.cmd
        if self.open_files is not None:  # through the shell: a preexec_fn in a process with threads may hang or die
            cmd = ["sh", "-c", f'ulimit -n {self.open_files} && exec "$@"', "sh", *cmd]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(self.startup_timeout) or not self.port:
            self.stop()
            raise RuntimeError(f"mtpserve serve did not start:\n{self.log}")
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the server and wait; returns its exit code (kills it if it hangs)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: Any, timeout: float = 15.0, interval: float = 0.1) -> Any:
    """Poll `predicate()` until it returns something truthy; returns it, or raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def rpc_error(fn: Any) -> grpc.RpcError:
    """Run `fn`, expecting a grpc.RpcError; returns it (fails the test if nothing was raised)."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("expected a gRPC error, the call succeeded")


def dummy_server_config(model: Path, num_draft_tokens: int = 3) -> Any:
    """The config of an in-process MTPServer on a dummy-weight model: a random draft head, 64 KV blocks, 4 requests,
    gRPC on a free loopback port."""
    from mtpserve.workers.config import MTPServeConfig

    return MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "load_format": "dummy", "device": "cpu"},
            "speculative": {"draft": "random", "num_draft_tokens": num_draft_tokens},
            "scheduler": {"num_kv_blocks": 64, "max_num_requests": 4},
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
        }
    )


def stream_all(
    address: str, n: int, tokens: int, errors: list[Any], done: list[int], base: int = 300
) -> list[threading.Thread]:
    """`n` threads, each streaming `tokens` greedy tokens over its own gRPC connection (prompt i: base + i and the
    three tokens after base): the lengths received go to `done`, each error as (when, status code) to `errors`."""

    from mtpserve.cluster.service.client import MTPServeClient

    def one(i: int) -> None:
        client = MTPServeClient(address)
        try:
            out = client.generate(
                token_ids=[base + i, base + 1, base + 2, base + 3], max_tokens=tokens, ignore_eos=True
            )
            done.append(len(out["token_ids"]))
        except grpc.RpcError as exc:
            errors.append((time.monotonic(), exc.code()))
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads
