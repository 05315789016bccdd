"""Model loading errors, HF-directory loading, and the `mtpserve generate --local` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpserve.cluster.engine.errors import ModelLoadError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.loader import convert_gguf, file_key, resolve_model
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import write_tiny_model
from tests.helpers.tiny import save_model_dir, tiny_args, tiny_weights

ROOT = Path(__file__).resolve().parents[2]


def test_missing_model_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(str(tmp_path)).args()


def test_corrupt_files_are_reported(tmp_path: Path) -> None:
    args = tiny_args()
    d = Path(save_model_dir(tmp_path / "m", args, tiny_weights(args)))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="corrupt"):
        resolve_model(str(d)).weights()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="GGUF"):
        resolve_model(str(bad), cache_dir=str(tmp_path / "cache"))


def test_conversion_cache_survives_what_image_layers_do_to_mtimes(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    data = bytearray(range(256)) * (3 * 4096 + 7)  # a little over 3 MiB: three samples that do not overlap
    gguf.write_bytes(data)
    key = file_key(gguf)
    done = tmp_path / "cache" / f"m-{key}"
    done.mkdir(parents=True)
    (done / ".complete").write_text(str(gguf))
    os.utime(gguf, ns=(0, 1_700_000_000_123_456_789))
    os.utime(gguf, (1_700_000_000, 1_700_000_000))  # a layer's tar keeps whole seconds only
    assert convert_gguf(gguf, cache_dir=str(tmp_path / "cache")) == done  # found, not converted again
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(data)
    assert file_key(copy) == key
    for offset in (0, len(data) // 2, len(data) - 1):  # a change in any sampled region, or in size, is seen
        changed = bytearray(data)
        changed[offset] ^= 1
        copy.write_bytes(changed)
        assert file_key(copy) != key, offset
    copy.write_bytes(data + b"\0")
    assert file_key(copy) != key


def test_hf_directory_loads_and_generates(tmp_path: Path) -> None:
    args = tiny_args()
    w = tiny_weights(args)
    d = save_model_dir(tmp_path / "m", args, w)
    cfg = MTPServeConfig.from_dict({"model": {"path": d, "device": "cpu"}, "speculative": {"enabled": False}})
    eng = LLMEngine.from_config(cfg)
    assert eng.tokenizer is None
    assert torch.equal(eng.target.model.embed_tokens.weight, w["model.embed_tokens.weight"])  # type: ignore[attr-defined]
    (out,) = eng.generate([[1, 2, 3]], {"max_tokens": 5})
    assert len(out.token_ids) == 5


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtpserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_generate_local_json(tmp_path: Path) -> None:
    model, head = write_tiny_model(tmp_path / "tiny")
    base = ["generate", "--local", "--model", str(model), "--device", "cpu", "--prompt", "Hello there", "--json"]
    fixed = ["--num-draft-tokens", "3", "--no-spec-adaptive"]
    spec = run_cli(*base, "--draft", str(head), *fixed, "--max-tokens", "12", "--chunk-size", "4")
    assert spec.returncode == 0, spec.stderr
    got = json.loads(spec.stdout)
    assert set(got) == {"token_ids", "text", "finish_reason", "stats"}
    assert len(got["token_ids"]) <= 12 and got["finish_reason"] in {"stop", "length"}
    stats = got["stats"]
    assert stats["drafted"] > 0 and len(stats["accepted_per_position"]) == 3
    plain = run_cli(*base, "--no-speculation", "--max-tokens", "12")
    assert json.loads(plain.stdout)["token_ids"] == got["token_ids"], "speculation must be lossless"
    raw = run_cli(*base, "--no-speculation", "--max-tokens", "4", "--raw")
    assert raw.returncode == 0 and len(json.loads(raw.stdout)["token_ids"]) <= 4
    tree_flags = ["--spec-tree-budget", "6", "--spec-tree-width", "2"]
    tree = run_cli(*base, "--draft", str(head), "--max-tokens", "12", *tree_flags)
    assert tree.returncode == 0, tree.stderr
    assert json.loads(tree.stdout)["token_ids"] == got["token_ids"], "tree drafting must be lossless"


def test_cli_errors_name_the_field(tmp_path: Path) -> None:
    bad = run_cli("generate", "--local", "--prompt", "x", "--chunk-size", "0")
    assert bad.returncode == 2 and "scheduler.chunk_size" in bad.stderr
    tree = run_cli("generate", "--local", "--prompt", "x", "--spec-tree-budget", "99")
    assert tree.returncode == 2 and "speculative.tree_budget" in tree.stderr
    missing = run_cli("generate", "--local", "--prompt", "x", "--model", str(tmp_path / "none"), "--device", "cpu")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    for cmd in ("generate", "serve", "bench", "train-draft"):
        h = run_cli(cmd, "--help")
        assert h.returncode == 0 and "usage" in h.stdout.lower()


def test_weights_load_straight_onto_the_device_and_unfilled_ones_are_refused() -> None:
    """The target is laid out on the meta device and loaded in place (tied embeddings stay one tensor); a
    parameter the checkpoint leaves unset, or sets to NaN, is refused by name."""
    from mtpserve.workers.builders import build_target

    args = tiny_args(tie_word_embeddings=True)
    w = tiny_weights(args)
    w.pop("lm_head.weight", None)
    model = build_target(args, w, torch.float32, "cpu")
    assert model.lm_head_weight is model.embed_tokens.weight
    assert torch.equal(model.norm.weight, w["model.norm.weight"])
    w["model.layers.1.input_layernorm.weight"] = torch.full_like(
        w["model.layers.1.input_layernorm.weight"], float("nan")
    )
    with pytest.raises(ModelLoadError, match=r"hold NaN.*layers\.1\.input_layernorm"):
        build_target(args, w, torch.float32, "cpu")


def test_large_dummy_models_get_their_random_weights_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dummy load of a Llama past the host limit (Llama-3-8B's shape) makes no host weights; a model built
    from it gets finite random weights in place, and one under the limit still gets seeded host weights."""
    import mtpserve.modeling.loader as loader
    from mtpserve.modeling.families import InPlaceDummy, approx_parameters
    from mtpserve.workers.builders import build_target

    big = tmp_path / "big"
    big.mkdir()
    llama_8b = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    (big / "config.json").write_text(json.dumps(llama_8b))
    src = resolve_model(str(big), "dummy")
    assert abs(approx_parameters(src.args()) - 8.03e9) < 0.01e9
    assert isinstance(src.weights(), InPlaceDummy)

    small = save_model_dir(tmp_path / "small", tiny_args(), tiny_weights(tiny_args()))
    src = resolve_model(str(small), "dummy")
    host = src.weights()
    assert not isinstance(host, InPlaceDummy) and "model.embed_tokens.weight" in host
    monkeypatch.setattr(loader, "HOST_DUMMY_MAX_PARAMETERS", 0)
    weights = src.weights()
    assert isinstance(weights, InPlaceDummy)
    model = build_target(src.args(), weights, torch.float32, "cpu")
    params = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert params["embed_tokens.weight"].std() > 0.01


def test_the_default_draft_follows_the_model_wherever_it_is_read_from() -> None:
    """`speculative.draft: default` gives SmolLM2-135M the shipped head also when the model is named by path
    (a staged GGUF, a converted directory); another shape by path gets no draft (with a warning)."""
    from mtpserve.workers.builders import DEFAULT_HEAD, draft_source
    from tests.helpers.tiny import engine_config, tiny_args

    smol = tiny_args(hidden_size=576, num_hidden_layers=30, vocab_size=49152)
    by_path = engine_config(
        model={"path": "/root/model/SmolLM2-135M-Instruct.Q4_1.gguf"}, speculative={"draft": "default"}
    )
    packaged = engine_config(speculative={"draft": "default"})
    assert draft_source(by_path, smol) == draft_source(packaged, smol) == str(DEFAULT_HEAD)
    assert draft_source(by_path, tiny_args()) is None
