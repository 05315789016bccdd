"""Qwen2 / Qwen3-style HF directories (and biased Llamas, and Llama 3's scaled RoPE) load as Llama-family
targets: logits equal HF transformers' in fp32, greedy decoding equals HF generate, and other architectures
are refused by model_type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.loader import resolve_model
from mtpserve.modeling.qwen import QwenArgs, QwenModel
from mtpserve.speculative.train.dense import target_features
from tests.helpers.hf_tiny import KINDS, load_ours, write_hf_target
from tests.helpers.tiny import engine_config, random_prompts

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {"llama-bias": {"attention_bias": True}, "llama-rope3": {"rope_parameters": LLAMA3_ROPE}}


@pytest.mark.parametrize("kind", [*KINDS, *VARIANTS])
def test_logits_match_hf_transformers(tmp_path: Path, kind: str) -> None:
    path, hf = write_hf_target(tmp_path / kind, kind.split("-")[0], **VARIANTS.get(kind, {}))
    model = load_ours(path)
    assert isinstance(model, QwenModel) == (kind not in ("llama", "llama-rope3"))
    n = 90 if kind == "llama-rope3" else 23  # past the scaled RoPE's original 64 positions
    ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        for prepared in (False, True):  # separate weights, then fused q/k/v (and biases) as served
            if prepared:
                model.prepare_for_inference()
            cache = model.allocate_cache(12, 8, "cpu")
            parts = []
            for lo, hi in ((0, 9), (9, n)):  # two chunks through the paged cache
                meta = AttentionMetadata.build([lo], [hi - lo], [list(range(12))], 8)
                parts.append(model.logits(model(ids[lo:hi], torch.arange(lo, hi), cache, meta)))
            # fp32, chunked through the paged cache: summation order differs from HF's (1.03e-5 seen at 90 rows)
            torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-5, atol=1e-5)
        dense = target_features(model, ids[None], (model.args.num_hidden_layers - 1,))[0, :, 0]
        torch.testing.assert_close(model.logits(dense), ref, rtol=1e-5, atol=1e-5, msg="the training forward differs")


def test_qwen_variants_from_config(tmp_path: Path) -> None:
    q2 = resolve_model(write_hf_target(tmp_path / "q2", "qwen2")[0]).args()
    q3 = resolve_model(write_hf_target(tmp_path / "q3", "qwen3", attention_bias=True)[0]).args()
    assert isinstance(q2, QwenArgs) and (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    assert isinstance(q3, QwenArgs) and (q3.qkv_bias, q3.o_bias, q3.qk_norm) == (True, True, True)
    assert q3.head_dim == 24 and q3.tie_word_embeddings


def test_engine_greedy_matches_hf_generate(tmp_path: Path) -> None:
    path, hf = write_hf_target(tmp_path / "q3", "qwen3")
    cfg = engine_config(speculative={"enabled": False})
    cfg.model.path = path
    from mtpserve.cluster.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_config(cfg, load_tokenizer=False)
    prompt = random_prompts(1, 96, [13], seed=4)[0]
    (out,) = eng.generate([prompt], {"max_tokens": 12})
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic' is not served"),
    ],
)
def test_unservable_configs_are_refused_naming_the_field(tmp_path: Path, change: dict, message: str) -> None:
    path = Path(write_hf_target(tmp_path / "q2", "qwen2")[0])
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(str(path)).args()


def test_fused_kernel_ops_serve_biases_and_head_norms(tmp_path: Path) -> None:
    """The Triton layer ops (interpreted on CPU) around the Qwen-style projection: large and small steps."""
    pytest.importorskip("triton")
    from mtpserve.modeling.layer_ops import TritonOps

    path, hf = write_hf_target(tmp_path / "q3", "qwen3", num_hidden_layers=1, head_dim=32, attention_bias=True)
    model = load_ours(path).prepare_for_inference(TritonOps())
    ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        cache = model.allocate_cache(8, 8, "cpu")
        parts = []
        for lo, hi in ((0, 20), (20, 22), (22, 23)):  # a prompt chunk, then steps small enough for the GEMV kernels
            meta = AttentionMetadata.build([lo], [hi - lo], [[0, 1, 2]], 8)
            parts.append(model.logits(model(ids[lo:hi], torch.arange(lo, hi), cache, meta)))
    assert (torch.cat(parts) - ref).abs().max().item() <= 1e-5
