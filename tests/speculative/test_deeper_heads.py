"""Draft heads of more than one decoder layer: a head grown from a one-layer head drafts exactly what its
source drafted, every step path (eager, fused captured step, separate chain step, trees) stays lossless and
proposes the same drafts, every layer's draft KV is chunk-invariant, the dense training forward equals the
paged chain layer by layer, and the file keeps its depth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.probes.grow_head import main as grow_main
from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.model import LlamaArgs, LlamaModel
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.train.dense import head_unrolled, target_features
from tests.helpers.tiny import draft_kv, random_prompts, save_model_dir, tiny_engine
from tests.speculative.test_head_layouts import check_step_paths_agree, fused_head, layered_target


def grown(head: MTPEagleHead, args: LlamaArgs, num_layers: int = 2) -> MTPEagleHead:
    """`head` grown to `num_layers` decoder layers (the extra ones start with no effect)."""
    deep = MTPEagleHead(args, **{**head.layout(), "num_layers": num_layers})
    deep.init_from_head(head)
    return deep


def switch_on(head: MTPEagleHead, seed: int = 9, scale: float = 0.3) -> None:
    """Give the extra layers' output projections random weights, so they change the drafts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in head.extra_layers:
            for name, p in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)


def run(args: LlamaArgs, w: dict[str, torch.Tensor], head: MTPEagleHead, prompts: list[list[int]], **spec: int):  # type: ignore[no-untyped-def]
    """Greedy outputs and (accepted, drafted) of an engine with `head`."""
    eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": 3, **spec})
    out = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 30})]
    return out, (eng.totals.accepted, eng.totals.drafted)


def test_grown_head_starts_as_its_source_and_stays_lossless(tmp_path: Path) -> None:
    args, w = layered_target()
    narrow = fused_head(args, w)
    deep = grown(narrow, args)
    assert deep.num_layers == 2 and len(deep.allocate_cache(4, 8, "cpu").keys) == 2
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=3)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]
    base_out, base_stats = run(args, w, narrow, prompts)
    assert base_out == ref and 0 < base_stats[0] < base_stats[1]
    assert run(args, w, deep, prompts) == (ref, base_stats), "the extra layer starts with no effect"

    switch_on(deep)
    out, stats = run(args, w, deep, prompts)
    assert out == ref and stats != base_stats, "the extra layer now changes the drafts; output stays the target's"
    tree_out, tree_stats = run(args, w, deep, prompts, tree_budget=8, tree_width=2)
    assert tree_out == ref and tree_stats[0] > 0

    deep.save(tmp_path / "d.safetensors")
    back = MTPEagleHead.load(tmp_path / "d.safetensors", args)
    assert back.num_layers == 2 and run(args, w, back, prompts) == (ref, stats)
    with pytest.raises(ValueError, match="2 layer"):
        narrow.init_from_head(back)


def test_every_step_path_proposes_the_same_drafts_with_two_layers() -> None:
    """Eager, the fused captured step with host overlap, and the separate chain step (all eager on CPU)."""
    args, w = layered_target()
    head = grown(fused_head(args, w), args)
    switch_on(head)
    check_step_paths_agree(args, w, head)


@pytest.mark.parametrize("chunk", [1, 5])
def test_every_layers_draft_kv_is_chunk_invariant(chunk: int) -> None:
    args, w = layered_target()
    head = grown(fused_head(args, w), args)
    switch_on(head)
    prompt = random_prompts(1, args.vocab_size, [37], seed=11)[0]

    def kv(c: int, layer: int) -> torch.Tensor:
        eng = tiny_engine(args, w, head, scheduler={"chunk_size": c, "max_num_batched_tokens": 64})
        rid = eng.add_request(prompt, {"max_tokens": 8})
        while eng.scheduler.requests[rid].in_context:
            eng.step()
        return draft_kv(eng, rid, len(prompt), layer)

    for layer in (0, 1):
        whole = kv(len(prompt), layer)
        assert whole.abs().mean() > 0.01
        assert (kv(chunk, layer) - whole).abs().max() <= 1e-5


def test_dense_unrolled_two_layer_head_equals_the_paged_chain() -> None:
    """What training scores (the dense unrolled head) is what the paged chain drafts, with two layers."""
    args, w = layered_target()
    model = LlamaModel(args)
    model.load_hf_state_dict(w)
    model.eval()
    head = grown(fused_head(args, w, vocab=False), args)
    switch_on(head, scale=1.0)
    head.eval()
    seq = torch.tensor(random_prompts(1, args.vocab_size, [19], seed=4)[0])
    bs, k = 4, 3
    with torch.no_grad():
        feats = target_features(model, seq[None], head.feature_layers).flatten(2)
        outs = head_unrolled(head, model, seq[None], feats, steps=k)
        for p in (0, 5, 12):
            cache = head.allocate_cache(8, bs, "cpu")
            table = list(range(8))
            m1 = AttentionMetadata.build([0], [p + 1], [table], bs)
            h = head.step(model, seq[1 : p + 2], feats[0, : p + 1], torch.arange(p + 1), cache, m1)
            assert (h - outs[0][0, : p + 1]).abs().max().item() <= 1e-4
            h = h[-1:]
            for j in range(2, k + 1):
                q = p + j - 1
                mj = AttentionMetadata.build([q], [1], [table], bs)
                h = head.step(model, seq[q + 1 : q + 2], h, torch.tensor([q]), cache, mj)
                assert (h - outs[j - 1][0, q : q + 1]).abs().max().item() <= 1e-4, (p, j)
        one = MTPEagleHead(args, head.feature_layers)
        one.init_from_head(fused_head(args, w, vocab=False))
        shallow = head_unrolled(one.eval(), model, seq[None], feats, steps=k)
        assert (shallow[0] - outs[0]).abs().max() > 1e-3, "the second layer is part of the forward"


def test_grow_head_script_writes_a_deeper_head_that_drafts_the_same(tmp_path: Path) -> None:
    """`bench/probes/grow_head.py`: the grown file has two layers and the engine's counters of its source."""
    args, w = layered_target()
    model_dir = save_model_dir(tmp_path / "target", args, w)
    src = fused_head(args, w)
    switch_on(src)
    src.save(tmp_path / "one.safetensors", {"note": "source"})
    out = tmp_path / "two.safetensors"
    assert grow_main(["--head", str(tmp_path / "one.safetensors"), "--model", model_dir, "--out", str(out)]) == 0
    deep = MTPEagleHead.load(out, args)
    assert deep.num_layers == 2
    prompts = random_prompts(4, args.vocab_size, [21, 9, 13, 30], seed=2)
    assert run(args, w, deep, prompts) == run(args, w, MTPEagleHead.load(tmp_path / "one.safetensors", args), prompts)
    with pytest.raises(SystemExit):
        grow_main(["--head", str(out), "--model", model_dir, "--decoder", "1", "--out", str(tmp_path / "x")])
