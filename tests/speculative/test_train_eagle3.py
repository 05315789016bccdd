"""`mtpserve train-draft --format eagle3` on CPU with a tiny random Qwen3-style target: the head it writes is an
EAGLE-3 checkpoint directory in the published layout, scores the same after the round trip through the file,
and drafts losslessly in the engine with `--spec-method eagle3`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtpserve.cluster.cli.mtpserve import main
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.qwen import QwenArgs, random_qwen_weights
from mtpserve.speculative.eagle3_head import Eagle3Head
from tests.helpers.tiny import engine_config, random_prompts

pytestmark = pytest.mark.slow  # the dataset and the training run take about 25 s on 2 cores

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
PUBLISHED = {  # SpecForge's LlamaForCausalLMEagle3 tensor names (the embedding is not stored)
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def cli(*argv: object) -> int:
    """Run `mtpserve` in process."""
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers of std 0.05, embedding and lm_head of std 0.5: the next token depends mostly on the current one
    and partly on the context, which a head learns within seconds (compare test_train_draft.py)."""
    d = tmp_path_factory.mktemp("qwen3-target")
    args = QwenArgs.from_hf_dict(CONFIG)
    w = random_qwen_weights(args, seed=0, std=0.05)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 5.0
    w["lm_head.weight"] = w["lm_head.weight"] * 5.0
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def trained(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(data folder, exported EAGLE-3 head, results) of one short run."""
    root = tmp_path_factory.mktemp("run")
    data, out = root / "data", root / "eagle3-head"
    rc = cli(
        "train-draft", "--stage", "data", "--target", target_dir, "--device", "cpu", "--data-dir", data,
        "--mix", "random=3", "--part-size", 32, "--max-new-tokens", 32, "--gen-batch-size", 32,
    )  # fmt: skip
    assert rc == 0
    rc = cli(
        "train-draft", "--stage", "train", "--format", "eagle3", "--target", target_dir, "--device", "cpu",
        "--data-dir", data, "--out", out, "--batch-size", 16, "--lr", "3e-3", "-k", 2, "--steps", 60,
        "--eval-every", 0, "--ckpt-every", 0, "--dev-fraction", "0.1", "--head-spec", "e3:layers=0/1/2,vocab=200",
        "--no-init-from-target",
    )  # fmt: skip
    assert rc == 0
    return data, out, json.loads(out.with_name("eagle3-head.results.json").read_text())


def test_the_head_is_written_in_the_published_layout(trained: tuple[Path, Path, dict]) -> None:
    _, out, res = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2], "SpecForge / SGLang: outputs"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3], "vLLM: inputs of the next layers"
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["num_hidden_layers"]) == (200, 256, 1)
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (64, 16, 2)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == PUBLISHED
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (64, 128), "q/k/v read [embedding | hidden]"
        assert f.get_tensor("fc.weight").shape == (64, 192)
        ids = torch.arange(200) + f.get_tensor("d2t")
        t2d = f.get_tensor("t2d")
        assert f.metadata()["format"] == "mtpserve-eagle3/1"
    assert t2d.dtype == torch.bool and int(t2d.sum()) == 200 and bool(t2d[ids].all())
    assert "EAGLE-3" in (out / "MODEL_CARD.md").read_text()
    # In development: 1.00 untrained, 1.36 after the 60 steps (CPU fp32 with fixed seeds is deterministic).
    assert res["dev"]["acceptance_length"] >= res["dev_initial"]["acceptance_length"] + 0.2, "it learned"


def test_the_file_round_trip_scores_the_same(target_dir: Path, trained: tuple[Path, Path, dict]) -> None:
    data, out, res = trained
    results = out.with_name("eval.json")
    rc = cli(
        "train-draft", "--stage", "eval", "--target", target_dir, "--device", "cpu", "--data-dir", data,
        "--head", out, "--results", results, "-k", 2, "--dev-fraction", "0.1",
    )  # fmt: skip
    assert rc == 0
    again = json.loads(results.read_text())["dev"]
    assert again["acceptance_length"] == pytest.approx(res["dev"]["acceptance_length"], abs=1e-9)
    assert again["per_position"] == pytest.approx(res["dev"]["per_position"], abs=1e-9)


def test_the_trained_head_drafts_losslessly_in_the_engine(target_dir: Path, trained: tuple[Path, Path, dict]) -> None:
    _, out, _ = trained
    prompts = random_prompts(4, 256, [12, 1, 30, 7], seed=5)
    plain = engine_config(speculative={"enabled": False})
    plain.model.path = str(target_dir)
    target_only = LLMEngine.from_config(plain, load_tokenizer=False)
    ref = [c.token_ids for c in target_only.generate(prompts, {"max_tokens": 24})]
    cfg = engine_config(speculative={"method": "eagle3", "draft": str(out), "num_draft_tokens": 2})
    cfg.model.path = str(target_dir)
    eng = LLMEngine.from_config(cfg, load_tokenizer=False)
    assert isinstance(eng.draft.head, Eagle3Head)  # type: ignore[union-attr]
    assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 24})] == ref
    assert eng.totals.accepted > 0


def test_a_frozen_lm_head_keeps_the_targets_rows(
    target_dir: Path, trained: tuple[Path, Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lm_head=frozen`: the exported EAGLE-3 head scores with the target's final norm and lm_head rows it started
    from, while a head trained alongside it moves them; `residual=normed` writes `norm_before_residual` and serves
    losslessly; a layout without an lm_head of its own refuses both keys."""
    data, _, _ = trained
    out = tmp_path / "heads"
    rc = cli(
        "train-draft", "--stage", "train", "--format", "eagle3", "--target", target_dir, "--device", "cpu",
        "--data-dir", data, "--out", out, "--batch-size", 16, "--lr", "3e-3", "-k", 2, "--steps", 3,
        "--eval-every", 0, "--ckpt-every", 0, "--dev-fraction", "0.1",
        "--head-spec", "frozen:layers=0/1/2,lm_head=frozen", "--head-spec", "trained:layers=0/1/2",
        "--head-spec", "normed:layers=0/1/2,residual=normed",
    )  # fmt: skip
    assert rc == 0
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        target = f.get_tensor("lm_head.weight").float(), f.get_tensor("model.norm.weight").float()
    heads = {}
    for name in ("frozen", "trained", "normed"):
        with safe_open(str(tmp_path / f"heads-{name}" / "model.safetensors"), "pt") as f:
            heads[name] = f.get_tensor("lm_head.weight").float(), f.get_tensor("norm.weight").float()
    assert torch.equal(heads["frozen"][0], target[0]) and torch.equal(heads["frozen"][1], target[1])
    assert not torch.equal(heads["trained"][0], target[0]), "a trained lm_head moves"
    assert not torch.equal(heads["trained"][1], target[1]), "a trained final norm moves"
    configs = {n: json.loads((tmp_path / f"heads-{n}" / "config.json").read_text()) for n in ("normed", "trained")}
    assert configs["normed"]["norm_before_residual"] is True and "norm_before_residual" not in configs["trained"]
    prompts = random_prompts(2, 256, [9, 21], seed=3)
    runs = []
    for spec in (
        {"enabled": False},
        {"method": "eagle3", "draft": str(tmp_path / "heads-normed"), "num_draft_tokens": 2},
    ):
        cfg = engine_config(speculative=spec)
        cfg.model.path = str(target_dir)
        eng = LLMEngine.from_config(cfg, load_tokenizer=False)
        runs.append([c.token_ids for c in eng.generate(prompts, {"max_tokens": 16})])
    assert eng.draft.head.midlayer.norm_before_residual  # type: ignore[union-attr]
    assert runs[1] == runs[0]
    for key in ("lm_head=frozen", "residual=normed"):
        base = ["train-draft", "--stage", "train", "--target", target_dir, "--device", "cpu", "--data-dir", data,
                "--out", tmp_path / "mtp", "--steps", 1, "--head-spec", f"h:{key}"]  # fmt: skip
        assert cli(*base) == 2
        assert key in capsys.readouterr().err


def test_layouts_the_other_engines_cannot_read_are_refused(
    target_dir: Path, trained: tuple[Path, Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _, _ = trained
    base = ["train-draft", "--stage", "train", "--format", "eagle3", "--target", target_dir, "--device", "cpu",
            "--data-dir", data, "--out", tmp_path / "x", "--steps", 1]  # fmt: skip
    for spec, reason in [
        ("h:layers=1/2/3", "stop before the last"),
        ("h:layers=0/1/2,decoder=2", "one decoder layer"),
    ]:
        assert cli(*base, "--head-spec", spec) == 2
        err = capsys.readouterr().err
        assert "--head-spec" in err and reason in err
    assert cli(*base[:-2], "--stage", "vocab", "--head", tmp_path / "x") == 2
    assert "--format" in capsys.readouterr().err


def test_without_a_spec_an_eagle3_run_trains_the_layout_that_measured_best(target_dir: Path) -> None:
    """`--format eagle3` with no --head-spec trains one head with EAGLE-3's default layers, the target's frozen
    final norm and lm_head, and the normed residual; `--format mtp` keeps the MTP head on the last layer."""
    from mtpserve.cluster.cli.cmd_train import options_from_args
    from mtpserve.cluster.cli.mtpserve import build_parser

    texts = {}
    for fmt in ("eagle3", "mtp"):
        args = build_parser().parse_args(
            ["train-draft", "--stage", "train", "--format", fmt, "--target", str(target_dir), "--device", "cpu"]
        )
        texts[fmt] = [h.text() for h in options_from_args(args).train.heads]
    assert texts["eagle3"] == ["head:layers=eagle3,vocab=0,lm_head=frozen,residual=normed"]
    assert texts["mtp"] == ["head:layers=last,vocab=0"]
