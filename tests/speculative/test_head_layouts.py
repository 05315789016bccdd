"""Draft heads that read fused target features (EAGLE-3 style) and draft over a reduced vocabulary: the
engine stays lossless, every step path (eager, fused captured step, separate chain step, overlap) proposes
the same drafts, the draft KV stays chunk-invariant, and the file format round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.layer_ops import TritonOps
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.mtp_head import MTPEagleHead, head_layout
from mtpserve.speculative.train.dense import target_features
from mtpserve.workers.chain_step import UniformChainStep
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.runner import TargetRunner
from tests.helpers.tiny import draft_kv, mimic_target, random_prompts, tiny_engine, with_steps

EXCLUDED = [3, 17, 40, 41, 77]  # ids the reduced draft vocabulary leaves out


def layered_target() -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """A 2-layer mimic target whose second layer adds little, so a head re-running layer 0 drafts well."""
    args, w = mimic_target(num_hidden_layers=2)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        w[f"model.layers.1.{name}"] = w[f"model.layers.1.{name}"] * 0.05
    return args, w


def fused_head(args: LlamaArgs, w: dict[str, torch.Tensor], vocab: bool = True) -> MTPEagleHead:
    """Fused features of layers 0 and 1, a vocabulary without EXCLUDED; mostly the next token's embedding
    (some acceptance), partly the fused hidden state (so the features change the drafts)."""
    ids = torch.tensor([i for i in range(args.vocab_size) if i not in EXCLUDED]) if vocab else None
    head = MTPEagleHead(args, (0, 1), ids)
    head.init_from_target(w, layer=0)
    d = args.hidden_size
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, :d] = torch.eye(d)
        head.eh_proj.weight[:, d:] = 0.3 * torch.eye(d)
        assert head.fc is not None
        head.fc.weight.copy_(
            torch.cat([torch.eye(d), 0.5 * torch.eye(d)], 1) + 0.05 * torch.randn(d, 2 * d, generator=g)
        )
    return head


@pytest.mark.parametrize("chunk", [4, 512])
def test_fused_vocab_head_is_lossless_and_drafts_only_its_vocabulary(chunk: int) -> None:
    args, w = layered_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=3)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]
    eng = tiny_engine(args, w, fused_head(args, w), scheduler={"chunk_size": chunk, "max_num_batched_tokens": 48})
    proposed: list[int] = []
    propose = eng.draft.propose  # type: ignore[union-attr]

    def spy(inputs):  # type: ignore[no-untyped-def]
        assert inputs.hidden_states.shape[1] == 2 * args.hidden_size, "the draft gets both layers' outputs"
        out = propose(inputs)
        proposed.extend(out.draft_token_ids.flatten().tolist())
        return out

    eng.draft.propose = spy  # type: ignore[method-assign,union-attr]
    assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 30})] == ref
    s = eng.totals
    assert 0 < s.accepted < s.drafted, "both the accept and the reject paths must be exercised"
    assert proposed and not set(proposed) & set(EXCLUDED)
    assert any(t in EXCLUDED for seq in ref for t in seq), "the target does use tokens the draft cannot propose"


def test_every_step_path_proposes_the_same_drafts() -> None:
    """Eager, the fused captured step with host overlap, and the separate chain step (all eager on CPU)."""
    args, w = layered_target()
    check_step_paths_agree(args, w, fused_head(args, w))


def check_step_paths_agree(args: LlamaArgs, w: dict[str, torch.Tensor], head: MTPEagleHead) -> None:
    """The eager engine, the fused captured step and the separate chain step give the same tokens and counters."""
    prompts = random_prompts(6, args.vocab_size, [21, 1, 9, 13, 30, 4], seed=8)
    k = 3
    ref = tiny_engine(args, w, head, speculative={"num_draft_tokens": k}, scheduler={"chunk_size": 6})
    want = [c.token_ids for c in ref.generate(prompts, {"max_tokens": 30})]

    fused_eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": k}, scheduler={"chunk_size": 6})
    runner = fused_eng.target
    assert isinstance(runner, TargetRunner)
    chain_step = FusedSpecStep(
        runner.model, runner.cache, fused_eng.draft, k, max_batch=8, max_blocks=12, device="cpu", use_graphs=False
    )  # type: ignore[arg-type]
    with_steps(fused_eng, chain=chain_step)
    chain_eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": k}, scheduler={"chunk_size": 6})
    chain = chain_eng.draft
    chain.uniform = UniformChainStep(chain, k, 8, 12, use_graphs=False)  # type: ignore[arg-type,union-attr]
    for eng in (fused_eng, chain_eng):
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 30})] == want
        assert (eng.totals.accepted, eng.totals.drafted) == (ref.totals.accepted, ref.totals.drafted)
    assert ref.totals.accepted > 0


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_fused_draft_kv_is_chunk_invariant(chunk: int) -> None:
    args, w = layered_target()
    prompt = random_prompts(1, args.vocab_size, [37], seed=11)[0]

    def kv(c: int) -> torch.Tensor:
        eng = tiny_engine(args, w, fused_head(args, w), scheduler={"chunk_size": c, "max_num_batched_tokens": 64})
        rid = eng.add_request(prompt, {"max_tokens": 8})
        while eng.scheduler.requests[rid].in_context:
            eng.step()
        return draft_kv(eng, rid, len(prompt))

    assert (kv(chunk) - kv(len(prompt))).abs().max() <= 1e-5


def test_forward_features_are_the_layer_outputs() -> None:
    """The paged forward's features equal the dense forward's layer outputs, and its hidden state the last."""
    args, w = layered_target()
    eng = tiny_engine(args, w, fused_head(args, w))
    model = eng.target.model  # type: ignore[union-attr]
    assert model.feature_layers == (0, 1)
    ids = torch.tensor(random_prompts(1, args.vocab_size, [12], seed=2)[0])
    meta = ragged_metadata([0], [12], [[1, 2]], eng.cfg.scheduler.block_size, device="cpu")
    cache = model.allocate_cache(4, eng.cfg.scheduler.block_size, "cpu")
    hidden, feats = model.forward_features(ids, torch.arange(12), cache, meta)
    dense = target_features(model, ids[None], (0, 1))[0]
    assert feats.shape == (12, 2 * args.hidden_size)
    assert torch.allclose(feats, dense.flatten(1), atol=1e-5)
    assert torch.equal(hidden, feats[:, args.hidden_size :])


def test_reduced_vocab_greedy_matches_the_restricted_argmax_on_both_ops() -> None:
    args, w = layered_target()
    head = fused_head(args, w)
    eng = tiny_engine(args, w, fused_head(args, w))
    shared = eng.target.model  # type: ignore[union-attr]
    h = torch.randn(7, args.hidden_size, generator=torch.Generator().manual_seed(1))
    full = shared.logits(h)
    assert head.vocab_ids is not None
    want = head.vocab_ids[full[:, head.vocab_ids].argmax(-1)]
    assert torch.equal(head.greedy_tokens(shared, h), want)
    assert torch.allclose(head.logits(shared, h), full[:, head.vocab_ids])
    pytest.importorskip("triton")
    ops, shared.norm.ops = shared.norm.ops, TritonOps()
    try:
        assert torch.equal(head.greedy_tokens(shared, h), want)
    finally:
        shared.norm.ops = ops


def test_head_file_round_trip_keeps_layout(tmp_path: Path) -> None:
    args, w = layered_target()
    head = fused_head(args, w)
    path = tmp_path / "h.safetensors"
    head.save(path, {"note": "x"}, dtype=torch.bfloat16)
    assert head_layout(path) == (0, 1)
    back = MTPEagleHead.load(path, args)
    assert back.feature_layers == (0, 1) and back.feature_size == 2 * args.hidden_size
    assert back.vocab_ids is not None and torch.equal(back.vocab_ids, head.vocab_ids)
    assert back.eh_proj.weight.dtype == torch.float32
    assert torch.allclose(back.fc.weight, head.fc.weight.to(torch.bfloat16).float())  # type: ignore[union-attr]
    plain = MTPEagleHead(args)
    plain.save(tmp_path / "p.safetensors")
    loaded = MTPEagleHead.load(tmp_path / "p.safetensors", args)
    assert loaded.fc is None and loaded.vocab_ids is None and loaded.feature_layers == (1,)


def test_wider_mlp_head_starts_as_its_source_and_stays_lossless(tmp_path: Path) -> None:
    """A head grown from a trained one to twice the MLP drafts exactly what it did; with its extra units
    switched on it drafts differently, the engine's output stays the target's, and the file keeps the width."""
    args, w = layered_target()
    narrow = fused_head(args, w)
    wide_size = 2 * args.intermediate_size
    wide = MTPEagleHead(args, (0, 1), narrow.vocab_ids, mlp_size=wide_size)
    wide.init_from_head(narrow)
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=3)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]

    def run(head: MTPEagleHead) -> tuple[list[list[int]], tuple[int, int]]:
        eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": 3})
        out = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 30})]
        return out, (eng.totals.accepted, eng.totals.drafted)

    base_out, base_stats = run(narrow)
    assert base_out == ref and 0 < base_stats[0] < base_stats[1]
    assert run(wide) == (ref, base_stats)
    g = torch.Generator().manual_seed(9)
    n = args.intermediate_size
    mlp = wide.layer.mlp
    with torch.no_grad():
        for extra in (mlp.gate_proj.weight[n:], mlp.up_proj.weight[n:], mlp.down_proj.weight[:, n:]):
            extra.copy_(torch.randn(extra.shape, generator=g))
    grown_out, grown_stats = run(wide)
    assert grown_out == ref and grown_stats != base_stats
    wide.save(tmp_path / "w.safetensors")
    back = MTPEagleHead.load(tmp_path / "w.safetensors", args)
    assert back.mlp_size == wide_size and run(back) == (ref, grown_stats)
    with pytest.raises(ValueError, match="MLP"):
        narrow.init_from_head(wide)


@pytest.mark.parametrize(
    ("layers", "vocab", "message"),
    [
        ((1, 0), None, "ascending"),
        ((0,), None, "end with the last layer"),
        ((0, 5), None, "in \\[0, 1\\]"),
        ((0, 1), torch.tensor([1, 1, 2]), "distinct"),
        ((0, 1), torch.tensor([0, 96]), "distinct token ids in \\[0, 96\\)"),
    ],
)
def test_bad_layouts_are_refused(layers: tuple[int, ...], vocab: torch.Tensor | None, message: str) -> None:
    args, _ = layered_target()
    with pytest.raises(ValueError, match=message):
        MTPEagleHead(args, layers, vocab)
