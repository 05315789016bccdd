"""EAGLE-3 draft checkpoints, as SpecForge / SGLang and vLLM speculators publish them, for Llama, Qwen2 and
Qwen3 targets: loading, lossless greedy output, the served draft against an independent reference forward,
chunk invariance, trees, every step path, and mismatches refused at start-up naming the field."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.loader import resolve_model
from mtpserve.modeling.model import DRAFT_POSITIONS, LlamaArgs
from mtpserve.speculative.eagle3_head import Eagle3Head
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.eagle3_tiny import mimic_tensors, reference_draft, write_eagle3_dir
from tests.helpers.hf_tiny import write_hf_target
from tests.helpers.tiny import draft_kv, engine_config, random_prompts
from tests.speculative.test_head_layouts import check_step_paths_agree

EXCLUDED = torch.tensor([3, 17, 40, 41, 77])  # ids a reduced draft vocabulary leaves out
PROMPTS = random_prompts(5, 96, [21, 1, 40, 9, 13], seed=3)
# (target kind, checkpoint layout, feature layers written in the config (None: the default), reduced vocabulary)
CASES = {
    "llama": ("llama", "specforge", None, False),
    "qwen2": ("qwen2", "speculators", [0, 3, 6], False),
    "qwen3": ("qwen3", "specforge", [2, 4, 6], True),
}


class Setup:
    """A mimic HF target of one kind and an EAGLE-3 checkpoint for it, both on disk."""

    def __init__(self, root: Path, case: str) -> None:
        kind, layout, layers, reduced = CASES[case]
        self.target, self.hf = write_hf_target(root / "target", kind, mimic=True, tie_word_embeddings=False)
        source = resolve_model(self.target)
        self.args: LlamaArgs = source.args()
        self.weights = source.weights()
        keep = torch.ones(self.args.vocab_size, dtype=torch.bool)
        keep[EXCLUDED] = False
        self.vocab_ids = keep.nonzero().flatten() if reduced else None
        self.tensors = mimic_tensors(self.args, self.weights, self.vocab_ids)
        self.draft = write_eagle3_dir(root / "eagle3", self.args, self.tensors, layout, layers)
        self.layers = tuple(layers) if layers is not None else (1, 3, 4)  # 8 layers: 1, L/2 - 1, L - 4

    def config(self, **spec: Any) -> MTPServeConfig:
        cfg = engine_config(speculative={"method": "eagle3", "draft": self.draft, **spec})
        cfg.model.path = self.target
        return cfg

    def engine(self, **spec: Any) -> LLMEngine:
        return LLMEngine.from_config(self.config(**spec), load_tokenizer=False)

    def reference(self, max_tokens: int = 30) -> list[list[int]]:
        cfg = engine_config(speculative={"enabled": False})
        cfg.model.path = self.target
        eng = LLMEngine.from_config(cfg, load_tokenizer=False)
        return [c.token_ids for c in eng.generate(PROMPTS, {"max_tokens": max_tokens})]

    def with_draft_copy(self, root: Path) -> Setup:
        """This setup with its checkpoint copied to `root` (to edit)."""
        other = copy.copy(self)
        other.draft = str(shutil.copytree(self.draft, root / "eagle3"))
        return other


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Setup]:
    """Each case's setup, built once per module."""
    cache: dict[str, Setup] = {}

    def get(case: str) -> Setup:
        if case not in cache:
            cache[case] = Setup(tmp_path_factory.mktemp(case), case)
        return cache[case]

    return get


@pytest.fixture(params=list(CASES))
def setup(request: pytest.FixtureRequest, built: Callable[[str], Setup]) -> Setup:
    return built(request.param)


def test_checkpoint_loads_as_published(setup: Setup) -> None:
    head = Eagle3Head.load(setup.draft, setup.args)
    assert head.feature_layers == setup.layers and head.feature_size == 3 * setup.args.hidden_size
    if setup.vocab_ids is None:
        assert head.vocab_ids is None and head.draft_vocab_size == setup.args.vocab_size
    else:
        assert head.vocab_ids is not None and torch.equal(head.vocab_ids, setup.vocab_ids)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, setup.tensors["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(head.midlayer.hidden_norm.weight, setup.tensors["midlayer.hidden_norm.weight"])
    assert head.lm_head is not None and torch.equal(head.lm_head.weight, setup.tensors["lm_head.weight"])
    assert head.embed_tokens is None, "no embedding in the checkpoint: the target's is used"
    positions = setup.args.max_position_embeddings + DRAFT_POSITIONS
    assert head.rotary.cos.shape[0] == positions, "positions past the draft config's 256"


def test_pytorch_bin_checkpoints_load_too(built: Callable[[str], Setup], tmp_path: Path) -> None:
    """A head may ship `pytorch_model.bin` instead of safetensors."""
    s = built("qwen2").with_draft_copy(tmp_path)
    (Path(s.draft) / "model.safetensors").unlink()
    torch.save(
        {k.replace("midlayer.", "layers.0."): v for k, v in s.tensors.items()}, Path(s.draft) / "pytorch_model.bin"
    )
    head = Eagle3Head.load(s.draft, s.args)
    assert torch.equal(head.fc.weight, s.tensors["fc.weight"]) and head.feature_layers == s.layers


def test_greedy_is_lossless_with_prefix_caching(setup: Setup) -> None:
    ref = setup.reference()
    eng = setup.engine()
    proposed: list[int] = []
    propose = eng.draft.propose  # type: ignore[union-attr]

    def spy(inputs):  # type: ignore[no-untyped-def]
        assert inputs.hidden_states.shape[1] == 3 * setup.args.hidden_size, "three layers' outputs reach the draft"
        out = propose(inputs)
        proposed.extend(out.draft_token_ids.flatten().tolist())
        return out

    eng.draft.propose = spy  # type: ignore[method-assign,union-attr]
    assert [c.token_ids for c in eng.generate(PROMPTS, {"max_tokens": 30})] == ref
    assert 0 < eng.totals.accepted < eng.totals.drafted, "both the accept and the reject paths are exercised"
    if setup.vocab_ids is not None:
        assert proposed and not set(proposed) & set(EXCLUDED.tolist())
    hits = eng.scheduler.prefix_hit_tokens
    assert [c.token_ids for c in eng.generate(PROMPTS, {"max_tokens": 30})] == ref, "again, from cached blocks"
    assert eng.scheduler.prefix_hit_tokens > hits


def test_served_draft_equals_an_independent_reference(setup: Setup) -> None:
    """Every draft row the engine computes (prompt rows from target features, chained rows from the draft's own
    outputs) equals a plain-torch EAGLE-3 forward over the same rows, with HF's layer outputs as features."""
    eng = setup.engine(num_draft_tokens=3)
    head = eng.draft.head  # type: ignore[union-attr]
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    step = head.step

    def record(shared, tokens, hidden, positions, cache, meta, rope=None):  # type: ignore[no-untyped-def]
        out = step(shared, tokens, hidden, positions, cache, meta, rope)
        calls.append((tokens.clone(), hidden.clone(), positions.clone(), out.clone()))
        return out

    head.step = record  # type: ignore[method-assign]
    prompt = PROMPTS[2]
    eng.generate([prompt], {"max_tokens": 2})
    first, *chain = calls[:3]  # the prompt's rows, then one call per chained draft
    assert first[0].shape[0] == len(prompt) and [c[0].shape[0] for c in chain] == [1, 1]
    with torch.no_grad():
        hs = setup.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # [i + 1]: layer i's output
    features = torch.cat([hs[i + 1][0] for i in setup.layers], dim=-1)
    tokens, hidden, positions = first[0].tolist(), list(features), first[2].tolist()
    assert tokens[:-1] == prompt[1:], "row i reads the token at i + 1"
    assert torch.allclose(first[1], features, atol=1e-5), "the target's features are HF's layer outputs"
    served = [first[3]]
    for c_tokens, c_hidden, c_pos, c_out in chain:  # a chained row reads the previous row's output
        tokens.append(int(c_tokens[0]))
        hidden.append(served[-1][-1])
        positions.append(int(c_pos[0]))
        assert torch.equal(c_hidden[0], served[-1][-1])
        served.append(c_out)
    cfg = json.loads((Path(setup.draft) / "config.json").read_text())
    cfg = cfg.get("transformer_layer_config", cfg)
    embed = setup.weights["model.embed_tokens.weight"]
    want_out, want_logits = reference_draft(setup.tensors, cfg, embed, tokens, hidden, positions)
    got_out = torch.cat(served)
    assert (got_out - want_out).abs().max().item() <= 1e-5
    shared = eng.draft.shared  # type: ignore[union-attr]
    assert (head.logits(shared, got_out) - want_logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("case", "chunk"), [("llama", 3), ("qwen2", 3), ("qwen3", 1), ("qwen3", 3), ("qwen3", 16)])
def test_draft_kv_is_chunk_invariant(built: Callable[[str], Setup], case: str, chunk: int) -> None:
    s = built(case)
    prompt = random_prompts(1, 96, [37], seed=11)[0]

    def kv(c: int) -> torch.Tensor:
        eng = LLMEngine.from_config(s.config(), load_tokenizer=False)
        eng.scheduler.cfg.chunk_size = c
        rid = eng.add_request(prompt, {"max_tokens": 8})
        while eng.scheduler.requests[rid].in_context:
            eng.step()
        return draft_kv(eng, rid, len(prompt))

    assert (kv(chunk) - kv(len(prompt))).abs().max() <= 1e-5


def test_trees_are_lossless(setup: Setup) -> None:
    s = setup
    eng = s.engine(num_draft_tokens=3, tree_budget=8, tree_width=3)
    eng.scheduler.cfg.chunk_size = 5
    assert [c.token_ids for c in eng.generate(PROMPTS, {"max_tokens": 30})] == s.reference()
    assert 0 < eng.totals.accepted < eng.totals.drafted


def test_adaptive_depth_is_lossless(built: Callable[[str], Setup]) -> None:
    s = built("qwen3")
    eng = s.engine(adaptive=True)
    assert [c.token_ids for c in eng.generate(PROMPTS, {"max_tokens": 30})] == s.reference()
    assert eng.totals.accepted > 0


def test_every_step_path_proposes_the_same_drafts(built: Callable[[str], Setup]) -> None:
    """Eager, the fused captured step and the separate chain step (all eager on CPU) with an EAGLE-3 head."""
    s = built("qwen2")
    check_step_paths_agree(s.args, s.weights, Eagle3Head.load(s.draft, s.args))


def _edit(setup: Setup, **changes: Any) -> None:
    path = Path(setup.draft) / "config.json"
    cfg = json.loads(path.read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    for key, value in changes.items():
        (layer if key in layer and key not in cfg else cfg)[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": 32}, "hidden_size: 32, but the target's hidden size is 64"),
        ({"vocab_size": 100}, "vocab_size: 100, but the target's vocabulary is 96"),
        ({"target_hidden_size": 128}, "target_hidden_size: 128"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}}, r"eagle_config\.eagle_aux_hidden_state"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}, "eagle_aux_hidden_state_layer_ids"),
        ({"draft_vocab_size": 90}, r"lm_head\.weight: shape \(96, 64\), expected \(90, 64\)|d2t"),
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic' is not served"),
    ],
)
def test_mismatches_are_refused_at_start_up(
    built: Callable[[str], Setup], tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    s = built("llama").with_draft_copy(tmp_path)
    _edit(s, **changes)
    with pytest.raises(ModelLoadError, match=field):
        s.engine()


def test_method_and_source_must_agree(built: Callable[[str], Setup], tmp_path: Path) -> None:
    s = built("llama")
    cfg = s.config()
    cfg.speculative.method = "mtp_eagle"
    with pytest.raises(ModelLoadError, match="--spec-method eagle3"):
        LLMEngine.from_config(cfg, load_tokenizer=False)
    cfg.speculative.method = "eagle3"
    cfg.speculative.draft = "default"
    with pytest.raises(ModelLoadError, match=r"speculative\.draft: speculative\.method 'eagle3' needs an EAGLE-3"):
        LLMEngine.from_config(cfg, load_tokenizer=False)
    head = str(tmp_path / "mtp.safetensors")
    from mtpserve.speculative.mtp_head import MTPEagleHead

    MTPEagleHead(s.args).save(head)
    cfg.speculative.draft = head
    with pytest.raises(ModelLoadError, match="is not an EAGLE-3 checkpoint directory"):
        LLMEngine.from_config(cfg, load_tokenizer=False)


@pytest.mark.slow
def test_the_readme_command_serves_an_eagle3_head(tmp_path: Path) -> None:
    """`mtpserve generate --local --model QWEN3_DIR --spec-method eagle3 --draft EAGLE3_DIR` (the README's
    command) on a Qwen3-style target with SmolLM2's tokenizer and a reduced draft vocabulary."""
    import subprocess
    import sys

    from tests.helpers.service import TOKENIZER_FILES, default_tokenizer_dir

    target, _ = write_hf_target(tmp_path / "qwen3", "qwen3", mimic=True, tie_word_embeddings=False, vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (default_tokenizer_dir() / name).is_file():
            shutil.copy(default_tokenizer_dir() / name, Path(target) / name)
    source = resolve_model(target)
    ids = torch.arange(0, 49152, 3)  # a draft vocabulary of every third token
    draft = write_eagle3_dir(tmp_path / "eagle3", source.args(), mimic_tensors(source.args(), source.weights(), ids))
    base = ["generate", "--local", "--model", target, "--device", "cpu", "--prompt", "Tell me about ships", "--json"]

    def run(*extra: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "mtpserve", *base, "--max-tokens", "16", *extra]
        done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    spec = run("--spec-method", "eagle3", "--draft", draft, "--num-draft-tokens", "3")
    assert spec["stats"]["drafted"] > 0
    assert run("--no-speculation")["token_ids"] == spec["token_ids"]
