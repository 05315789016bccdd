"""An EAGLE-3 head through Ray actors: a Llama, Qwen2 or Qwen3-style target over 2 TP ranks, the draft on its
own worker (the three layers' outputs travel over gRPC) or colocated on rank 0; same tokens as one process
without drafting, and the draft worker's KV is chunk-invariant."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpserve.cluster.distributed.build import build_engine
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.loader import resolve_model
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.eagle3_tiny import mimic_tensors, write_eagle3_dir
from tests.helpers.hf_tiny import write_hf_target
from tests.helpers.tiny import random_prompts

pytestmark = pytest.mark.slow


def write_model(root: Path, kind: str) -> tuple[str, str]:
    """A mimic target of `kind` and an EAGLE-3 checkpoint for it (SpecForge layout, layers 2, 4, 6)."""
    target, _ = write_hf_target(root / "target", kind, mimic=True, tie_word_embeddings=False)
    source = resolve_model(target)
    args = source.args()
    draft = write_eagle3_dir(root / "draft", args, mimic_tensors(args, source.weights()), "specforge", [2, 4, 6])
    return target, draft


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return write_model(tmp_path_factory.mktemp("eagle3"), "qwen3")


def config(model: tuple[str, str], placement: str, enabled: bool = True) -> MTPServeConfig:
    return MTPServeConfig.from_dict(
        {
            "model": {"path": model[0], "device": "cpu", "dtype": "float32"},
            "scheduler": {"num_kv_blocks": 256, "block_size": 8, "max_num_requests": 8, "chunk_size": 5},
            "speculative": {"enabled": enabled, "method": "eagle3", "draft": model[1], "num_draft_tokens": 3},
            "parallel": {"tp_size": 2, "draft_placement": placement},
        }
    )


PLACEMENTS = [("qwen3", "separate"), ("qwen3", "colocated"), ("llama", "separate"), ("qwen2", "separate")]


@pytest.mark.parametrize(("kind", "placement"), PLACEMENTS)
def test_eagle3_through_actors(ray_local, model: tuple[str, str], tmp_path: Path, kind: str, placement: str) -> None:
    import ray

    model = model if kind == "qwen3" else write_model(tmp_path, kind)
    prompts = random_prompts(4, 96, [23, 1, 37, 9], seed=13)
    plain = LLMEngine.from_config(config(model, placement, enabled=False), load_tokenizer=False)
    ref = [c.token_ids for c in plain.generate(prompts, {"max_tokens": 16})]
    eng = build_engine(config(model, placement))
    try:
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 16})] == ref
        assert 0 < eng.totals.accepted < eng.totals.drafted
        if placement == "colocated":
            return
        hops = eng.target.hops  # type: ignore[attr-defined]
        assert hops["draft_inputs_bytes"] >= (23 + 1 + 37 + 9) * 3 * 64 * 4, "three layers' outputs per row"
        kv = {}
        eng.scheduler.prefix_caching = False
        for chunk in (3, 512):
            eng.scheduler.cfg.chunk_size = chunk
            rid = eng.add_request(prompts[2], {"max_tokens": 20})
            req = eng.scheduler.requests[rid]
            while req.in_context:
                eng.step()
            group = eng.target.group  # type: ignore[attr-defined]
            kv[chunk] = ray.get(group.draft.draft_kv.remote(req.block_ids, len(prompts[2])))
            eng.abort(rid)
        assert (kv[3] - kv[512]).abs().max().item() <= 1e-5
        assert kv[3].shape[2] == 4, "the draft's own KV heads (its config's), not the target's"
    finally:
        eng.shutdown()


def test_draft_worker_refuses_a_mismatched_head_at_start_up(ray_local, model: tuple[str, str], tmp_path: Path) -> None:
    import json
    import shutil

    draft = Path(shutil.copytree(model[1], tmp_path / "draft"))
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 9]
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"eagle_config\.eagle_aux_hidden_state_layer_ids"):
        build_engine(config((model[0], str(draft)), "separate")).shutdown()
