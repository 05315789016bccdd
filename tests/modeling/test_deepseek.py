"""DeepSeek-V3-family targets: HF parity (MLA, MoE, YaRN, interleaved RoPE), the native MTP modules, and
MTP Eagle / vanilla MTP drafting: lossless, chunk-invariant draft KV, sampling distribution, TP, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpserve.cluster.engine.errors import ModelLoadError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.deepseek import DeepseekV3Model
from mtpserve.modeling.families import InPlaceDummy, args_from_config
from mtpserve.modeling.loader import resolve_model
from mtpserve.modeling.mla import LatentCache
from mtpserve.speculative.mtp_native import native_heads
from mtpserve.speculative.mtp_vanilla import VanillaMTPChain
from tests.helpers.deepseek_tiny import (
    mimic_deepseek_args,
    tiny_deepseek_args,
    tiny_deepseek_weights,
    write_tiny_deepseek,
)
from tests.helpers.tiny import engine_config, random_prompts, same_distribution_pvalue, second_token_counts, slots_of

ROOT = Path(__file__).resolve().parents[2]
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_checkpoint(path: Path, rope: dict[str, Any] | None, q_lora: int | None = 32) -> tuple[Path, Any]:
    """An HF DeepseekV3ForCausalLM with random weights saved by transformers itself (per-expert tensor names),
    with two MTP modules added the way DeepSeek's checkpoints carry them; returns (directory, HF model)."""
    import transformers

    args = tiny_deepseek_args(q_lora_rank=q_lora)
    cfg = {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size")}
    cfg.update(
        {
            k: getattr(args, k)
            for k in args.__dataclass_fields__
            if k not in cfg and k not in {"rope_parameters", "head_dim"}
        }
    )
    cfg.update(rope_parameters=rope or args.rope_parameters, initializer_range=0.1, eos_token_id=None)
    config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"})
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(str(path))
    mtp = {k: v for k, v in tiny_deepseek_weights(args, seed=5).items() if _layer_index(k) >= args.num_hidden_layers}
    save_file(mtp, str(path / "mtp.safetensors"))
    return path, hf


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn"])
@pytest.mark.parametrize("q_lora", [32, None], ids=["q-lora", "q-proj"])
def test_logits_match_hf_transformers(tmp_path: Path, rope: dict | None, q_lora: int | None) -> None:
    path, hf = hf_checkpoint(tmp_path / "m", rope, q_lora)
    source = resolve_model(str(path))
    args = source.args()
    model = DeepseekV3Model(args)
    model.load_hf_state_dict(source.weights())
    model.eval()
    ids = torch.randint(0, args.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        cache = model.allocate_cache(8, 8, "cpu")
        assert isinstance(cache, LatentCache) and cache.keys[0].shape[-1] == args.kv_lora_rank + args.qk_rope_head_dim
        parts = []
        for lo, hi in ((0, 9), (9, 23)):  # two chunks through the latent cache
            meta = AttentionMetadata.build([lo], [hi - lo], [[0, 1, 2]], 8)
            parts.append(model.logits(model(ids[lo:hi], torch.arange(lo, hi), cache, meta)))
    ours = torch.cat(parts)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_engine_greedy_matches_hf_generate(tmp_path: Path) -> None:
    path, hf = hf_checkpoint(tmp_path / "m", YARN)
    cfg = engine_config(speculative={"draft": "native", "num_draft_tokens": 2})
    cfg.model.path = str(path)
    eng = LLMEngine.from_config(cfg, load_tokenizer=False)
    prompt = random_prompts(1, 96, [13], seed=4)[0]
    (out,) = eng.generate([prompt], {"max_tokens": 16})
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt) :].tolist()
    assert out.stats.drafted > 0


def test_native_module_matches_a_dense_reference() -> None:
    """The module's draft output equals enorm/hnorm/eh_proj, then HF's own DeepSeek decoder layer over the
    whole row sequence, then shared_head.norm and the lm_head, from the target's final-normed hidden states."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    args = tiny_deepseek_args(rope_interleave=False)
    w = tiny_deepseek_weights(args, seed=2)
    eng = LLMEngine.from_weights(engine_config(speculative={"draft": "native", "num_draft_tokens": 1}), args, w)
    prompt = random_prompts(1, 96, [12], seed=9)[0]
    rid = eng.add_request(prompt, {"max_tokens": 4})
    eng.step()  # the whole prompt: target rows, then the module's 12 rows and one draft
    req = eng.scheduler.requests[rid]
    draft = req.draft_token_ids[0]

    target = eng.target.model  # type: ignore[attr-defined]
    cache = target.allocate_cache(8, 8, "cpu")
    with torch.no_grad():
        hidden = target(torch.tensor(prompt), torch.arange(12), cache, AttentionMetadata.build([0], [12], [[0, 1]], 8))
        rows = torch.tensor([*prompt[1:], req.output_token_ids[0]])  # token i+1 at row i
        p = f"model.layers.{args.num_hidden_layers}."
        norm = lambda x, name: torch.nn.functional.rms_norm(x, (x.shape[-1],), w[p + name], args.rms_norm_eps)  # noqa: E731
        h = norm(torch.nn.functional.rms_norm(hidden, (64,), w["model.norm.weight"], args.rms_norm_eps), "hnorm.weight")
        x = torch.cat([norm(w["model.embed_tokens.weight"][rows], "enorm.weight"), h], -1) @ w[p + "eh_proj.weight"].T
        hf_cfg = transformers.DeepseekV3Config(
            **{
                k: getattr(args, k)
                for k in args.__dataclass_fields__
                if k not in {"rope_parameters", "head_dim", "eos_token_id"}
            }
        )
        layer = DeepseekV3DecoderLayer(hf_cfg, args.num_hidden_layers).eval()
        sd = {
            k[len(p) :]: v
            for k, v in w.items()
            if k.startswith(p) and not k[len(p) :].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))
        }
        layer.load_state_dict(sd)
        pos = torch.arange(12)[None]
        rope = DeepseekV3RotaryEmbedding(hf_cfg)(x[None], pos)
        mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]
        logits = norm(out, "shared_head.norm.weight") @ w["lm_head.weight"].T
    assert int(logits[-1].argmax()) == draft


def _engine(args: Any, w: dict, method: str, k: int, enabled: bool = True, **sched: Any) -> LLMEngine:
    spec = {"draft": "native", "num_draft_tokens": k, "method": method, "enabled": enabled}
    return LLMEngine.from_weights(engine_config(speculative=spec, scheduler=sched), args, w)


@pytest.mark.parametrize(("method", "k"), [("mtp_eagle", 1), ("mtp_eagle", 3), ("mtp_vanilla", 2)])
@pytest.mark.parametrize("chunk", [4, 512])
def test_greedy_drafting_is_lossless(method: str, k: int, chunk: int) -> None:
    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=k)
    ref = [c.token_ids for c in _engine(args, w, method, k, enabled=False).generate(prompts, {"max_tokens": 30})]
    eng = _engine(args, w, method, k, chunk_size=chunk, max_num_batched_tokens=48)
    out = eng.generate(prompts, {"max_tokens": 30})
    assert [c.token_ids for c in out] == ref
    s = eng.totals
    assert s.drafted == k * s.verify_steps
    assert 0 < s.accepted < s.drafted, "both the accept and the reject paths must be exercised"
    assert s.acceptance_length > 1.3


def _module_kv(eng: LLMEngine, rid: str, n: int) -> list[torch.Tensor]:
    """Each draft module's latent rows [n, 1, width] for positions [0, n) of a running request."""
    req = eng.scheduler.requests[rid]
    draft = eng.draft
    caches = draft.caches if isinstance(draft, VanillaMTPChain) else [draft.cache]  # type: ignore[union-attr]
    return [c.gather(0, slots_of(req.block_ids, c.block_size, n))[0].clone() for c in caches]


def _prefill_kv(method: str, chunk: int, source: str = "prompt") -> list[torch.Tensor]:
    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    spec = {"draft": "native", "num_draft_tokens": 2, "method": method, "lookahead_source": source}
    sched = {"chunk_size": chunk, "max_num_batched_tokens": 64}
    eng = LLMEngine.from_weights(engine_config(speculative=spec, scheduler=sched), args, w)
    prompt = random_prompts(1, args.vocab_size, [29], seed=11)[0]
    rid = eng.add_request(prompt, {"max_tokens": 8})
    req = eng.scheduler.requests[rid]
    while req.in_context:
        eng.step()
    # rows module j has written by now: up to the last prompt row minus j (module 0 reads the sampled token)
    return [kv[: len(prompt) - j] for j, kv in enumerate(_module_kv(eng, rid, len(prompt)))]


@pytest.mark.parametrize("method", ["mtp_eagle", "mtp_vanilla"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_draft_kv_is_chunk_invariant(method: str, chunk: int) -> None:
    whole = _prefill_kv(method, 29)
    chunked = _prefill_kv(method, chunk)
    assert len(whole) == (2 if method == "mtp_vanilla" else 1)
    for a, b in zip(chunked, whole, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_sampled_lookahead_breaks_invariance_for_vanilla_mtp() -> None:
    whole = _prefill_kv("mtp_vanilla", 29, "sampled")
    buggy = _prefill_kv("mtp_vanilla", 5, "sampled")
    bad = [(a - b).abs().amax(dim=(1, 2)) > 1e-5 for a, b in zip(buggy, whole, strict=True)]
    assert bad[0].any() and bad[1].any(), "the pre-fix behaviour must show up in every module"


def test_sampling_distribution_is_unchanged_by_drafting() -> None:
    """The second generated token (the first one verification decides) has the target's distribution."""
    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    prompt = random_prompts(1, args.vocab_size, [10], seed=2)[0]
    counts = []
    for enabled in (False, True):
        eng = _engine(args, w, "mtp_vanilla", 2, enabled=enabled)
        counts.append(second_token_counts(eng, prompt, 600, args.vocab_size))
        if enabled:
            assert eng.totals.accepted > 0
    assert same_distribution_pvalue(counts) > 1e-3


def test_vanilla_needs_enough_modules_and_keeps_prefix_caching_honest() -> None:
    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    with pytest.raises(ModelLoadError, match="2 MTP module"):
        _engine(args, w, "mtp_vanilla", 3)
    assert _engine(args, w, "mtp_vanilla", 2).cfg.prefix_caching is False
    assert _engine(args, w, "mtp_eagle", 2).cfg.prefix_caching is True
    heads = native_heads(args, w)
    assert len(heads) == 2 and all(h.final_norm is not None and h.normed_input for h in heads)
    missing = {k: v for k, v in w.items() if not k.startswith("model.layers.1.eh_proj")}
    with pytest.raises(ModelLoadError, match=r"MTP module 0 .*eh_proj"):
        native_heads(args, missing)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    cfg = json.loads(json.dumps({"model_type": "deepseek_v3", "vocab_size": 10, "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match=r"intermediate_size|num_hidden_layers"):
        args_from_config(cfg)
    args = tiny_deepseek_args()
    bad = {**{k: getattr(args, k) for k in args.__dataclass_fields__}, "model_type": "deepseek_v3", "n_group": 3}
    with pytest.raises(ModelLoadError, match="n_group"):
        args_from_config(bad)
    with pytest.raises(ModelLoadError, match="model_type 'mamba'"):
        args_from_config({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})


def test_stacked_and_per_expert_checkpoints_load_the_same(tmp_path: Path) -> None:
    path, _ = hf_checkpoint(tmp_path / "m", None)
    per_expert = {**load_file(str(path / "model.safetensors"))}
    args = resolve_model(str(path)).args()
    a = DeepseekV3Model(args)
    a.load_hf_state_dict(per_expert)
    stacked = {k: v for k, v in per_expert.items() if ".experts." not in k}
    for i in range(args.first_k_dense_replace, args.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        e = range(args.n_routed_experts)
        gate_up = [torch.cat([per_expert[f"{p}{j}.gate_proj.weight"], per_expert[f"{p}{j}.up_proj.weight"]]) for j in e]
        stacked[p + "gate_up_proj"] = torch.stack(gate_up)
        stacked[p + "down_proj"] = torch.stack([per_expert[f"{p}{j}.down_proj.weight"] for j in e])
    b = DeepseekV3Model(args)
    b.load_hf_state_dict(stacked)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtpserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("method", ["mtp_eagle", "mtp_vanilla"])
def test_generate_local_with_native_mtp(tmp_path: Path, method: str) -> None:
    model = str(write_tiny_deepseek(tmp_path / "ds"))
    base = ["generate", "--local", "--model", model, "--device", "cpu", "--prompt", "Tell me about ships", "--json"]
    spec = run_cli(*base, "--spec-method", method, "--num-draft-tokens", "2", "--max-tokens", "16", "--chunk-size", "3")
    assert spec.returncode == 0, spec.stderr
    got = json.loads(spec.stdout)
    assert got["stats"]["drafted"] > 0 and got["stats"]["accepted"] > 0
    plain = run_cli(*base, "--no-speculation", "--max-tokens", "16")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["token_ids"] == got["token_ids"]


def test_dummy_load_builds_real_shapes_in_place(tmp_path: Path) -> None:
    """`--load-format dummy` makes no host weights for DeepSeek-V3 (real shapes are tens of GB): the target
    and its native MTP module are built on the meta device, then given storage and random weights."""
    args = tiny_deepseek_args()
    d = tmp_path / "cfg-only"
    d.mkdir()
    cfg = {k: getattr(args, k) for k in args.__dataclass_fields__}
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    assert isinstance(resolve_model(str(d), "dummy").weights(), InPlaceDummy)
    spec = {"draft": "native", "num_draft_tokens": 2, "method": "mtp_vanilla"}
    config = engine_config(speculative=spec)
    config.model.path, config.model.load_format = str(d), "dummy"
    eng = LLMEngine.from_config(config, load_tokenizer=False)
    target = eng.target.model  # type: ignore[attr-defined]
    assert all(not p.is_meta and torch.isfinite(p).all() for p in target.parameters())
    assert target.layers[1].mlp.experts.gate_up_proj.std() > 0  # type: ignore[union-attr]
    (out,) = eng.generate([[3, 1, 4, 1, 5]], {"max_tokens": 6})
    assert len(out.token_ids) == 6 and out.stats.drafted > 0


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight to float8 e4m3 with one scale per block x block tile, as DeepSeek-V3 ships it."""
    rows, cols = w.shape
    sr, sc = -(-rows // block), -(-cols // block)
    pad = torch.nn.functional.pad(w, (0, sc * block - cols, 0, sr * block - rows))
    tiles = pad.view(sr, block, sc, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(sr * block, sc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_quantised_checkpoint_loads_dequantised() -> None:
    """Blocks of the config's `weight_block_size`, also where a weight's rows are not a multiple of it
    (kv_a_proj_with_mqa: 40 rows in 16-row blocks, whose scales alone would suggest 14-row blocks)."""
    args = tiny_deepseek_args(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    w = tiny_deepseek_weights(args)
    quantised, dequantised = dict(w), dict(w)
    assert w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape[0] == 40
    for name, t in w.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2 and "layers.0." in name:
            q, scale = fp8_blocks(t, 16)
            quantised[name], quantised[name + "_scale_inv"] = q, scale
            dequantised[name] = (
                q.float() * scale.repeat_interleave(16, 0)[: t.shape[0]].repeat_interleave(16, 1)[:, : t.shape[1]]
            )
    assert any(v.dtype == torch.float8_e4m3fn for v in quantised.values())
    a, b = DeepseekV3Model(args), DeepseekV3Model(args)
    a.load_hf_state_dict(quantised)
    b.load_hf_state_dict(dequantised)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert (dequantised[name] - w[name]).abs().max() < 0.1 * w[name].abs().max(), name  # fp8 keeps them
    wrong = tiny_deepseek_args(quantization_config={"weight_block_size": [8, 8]})
    with pytest.raises(ValueError, match="do not tile"):
        DeepseekV3Model(wrong).load_hf_state_dict(quantised)


def test_router_stays_fp32_in_a_bf16_model() -> None:
    """Expert choice turns on small score gaps, so the router (and its bias) are not rounded to bf16."""
    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    cfg = engine_config(model={"dtype": "bfloat16"}, speculative={"draft": "native", "num_draft_tokens": 1})
    eng = LLMEngine.from_weights(cfg, args, w)
    gate = eng.target.model.layers[0].mlp.gate  # type: ignore[attr-defined]
    assert gate.weight.dtype == torch.float32 and torch.equal(gate.weight, w["model.layers.0.mlp.gate.weight"])
    assert torch.equal(gate.e_score_correction_bias, w["model.layers.0.mlp.gate.e_score_correction_bias"])
    assert eng.target.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.bfloat16  # type: ignore[attr-defined]
    (out,) = eng.generate([[3, 1, 4, 1, 5, 9]], {"max_tokens": 6})
    assert len(out.token_ids) == 6


def test_unservable_configs_and_empty_checkpoints_are_refused(tmp_path: Path) -> None:
    args = tiny_deepseek_args()
    cfg = {**{k: getattr(args, k) for k in args.__dataclass_fields__}, "model_type": "deepseek_v3"}
    dynamic = {**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'"):
        args_from_config(dynamic)
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="hold no tensors"):
        resolve_model(str(d)).weights()
    from mtpserve.workers.builders import draft_source

    llama = engine_config(speculative={"method": "mtp_vanilla", "draft": "random"})
    from tests.helpers.tiny import tiny_args

    with pytest.raises(ModelLoadError, match="needs the checkpoint's own MTP modules"):
        draft_source(llama, tiny_args())


def test_one_kv_head_attention_matches_sdpa_and_tiles_long_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Latent attention's one shared key head: equal to SDPA over keys copied to every head, also when the
    queries go in slices to bound the score memory."""
    from mtpserve.modeling import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 8, 37, 16, generator=g),
        torch.randn(2, 1, 50, 16, generator=g),
        torch.randn(2, 1, 50, 12, generator=g),
    )
    mask = torch.rand(2, 1, 37, 50, generator=g) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(-1, 8, -1, -1), v.expand(-1, 8, -1, -1), attn_mask=mask, scale=0.25
    )
    whole = attention.one_kv_head_attention(q, k, v, mask, scale=0.25)
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2 * 8 * 50 * 5)  # five query rows per pass
    tiled = attention.one_kv_head_attention(q, k, v, mask, scale=0.25)
    assert (whole - ref).abs().max().item() <= 1e-5
    assert torch.equal(tiled, whole)
