"""Draft trees in the engine: the draft grows each branch as the chain would, verification over the tree is
lossless in greedy decoding and in sampling, and a width-1 tree is the chain."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling import fused_kernels
from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.layer_ops import TORCH_OPS, TritonOps
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.speculative.tree import DraftTree
from mtpserve.workers import tree_step
from mtpserve.workers.builders import DEFAULT_HEAD
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.tree_inputs import TreeBuffers
from mtpserve.workers.tree_step import FusedTreeStep
from tests.helpers.smol import CHAT_PROMPTS, smollm2, smollm2_engine
from tests.helpers.tiny import (
    engine_config,
    mimic_head,
    mimic_target,
    random_prompts,
    same_distribution_pvalue,
    second_token_counts,
    tiny_engine,
    with_steps,
)

TREES = [
    {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3},
    {"num_draft_tokens": 4, "tree_budget": 24, "tree_width": 4},
    {"num_draft_tokens": 1, "tree_budget": 3, "tree_width": 4},
]


def tree_engine(spec: dict[str, int], chunk: int = 512, **sections: dict[str, object]) -> LLMEngine:
    """A tiny mimic engine drafting trees."""
    args, w = mimic_target()
    scheduler = {"chunk_size": chunk, "max_num_batched_tokens": 128, **sections.pop("scheduler", {})}
    return tiny_engine(args, w, mimic_head(args, w), scheduler=scheduler, speculative=spec, **sections)


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """Drafted tokens from below the root down to `node`."""
    out = []
    while node > 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


@torch.no_grad()
def test_every_branch_scores_as_the_sequential_chain() -> None:
    """Each kept node's cumulative draft log-probability equals that of running the head one token at a time
    down its branch (fp32, 1e-4): the tree's masks, positions and parent outputs are right."""
    eng = tree_engine({"num_draft_tokens": 4, "tree_budget": 30, "tree_width": 3})
    drafter = eng.draft
    assert isinstance(drafter, MTPEagleTree)
    args = eng.args
    prompts = random_prompts(2, args.vocab_size, [13, 7], seed=5)
    rids = [eng.add_request(p, {"max_tokens": 8}) for p in prompts]
    plan = eng.scheduler.schedule()
    assert all(s.is_final_chunk for s in plan.seqs)
    inputs = eng.target.execute(plan).draft_inputs
    assert inputs is not None
    out, _ = drafter.chain.rerun(inputs)
    ends = torch.cumsum(torch.tensor(inputs.seq_lens), 0) - 1
    roots = inputs.positions[ends].tolist()
    tokens, parents, scores = drafter.grow_eager(out[ends], roots, inputs.block_ids)
    head, shared, cache = drafter.chain.head, drafter.chain.shared, drafter.chain.cache
    checked = 0
    for b, rid in enumerate(rids):
        tree = DraftTree.from_drafts([0, *tokens[b].tolist()], parents[b].tolist())
        table = eng.scheduler.requests[rid].block_ids
        assert int(tree.depth().max()) == 4
        for node in range(1, tree.size):
            h, score = out[ends[b]][None], 0.0
            for j, tok in enumerate(path_tokens(tree, node)):
                score += float(torch.log_softmax(head.logits(shared, h), -1)[0, tok])
                pos = roots[b] + 1 + j
                meta = ragged_metadata([pos], [1], [table], cache.block_size)
                h = head.step(shared, torch.tensor([tok]), h, torch.tensor([pos]), cache, meta)
            assert score == pytest.approx(float(scores[b, node - 1]), abs=1e-4)
            checked += 1
    assert checked == 60


@pytest.mark.parametrize("spec", TREES)
@pytest.mark.parametrize("chunk", [4, 512])
def test_tree_greedy_is_lossless(spec: dict[str, int], chunk: int) -> None:
    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=3)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]
    eng = tree_engine(spec, chunk)
    out = eng.generate(prompts, {"max_tokens": 30})
    assert [c.token_ids for c in out] == ref
    s = eng.totals
    assert 0 < s.accepted < s.drafted, "both the accept and the reject paths must be exercised"
    assert s.acceptance_length > 1.3
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks, "every KV block comes back"


@pytest.mark.skipif(not fused_kernels.available(), reason="triton is not installed")
def test_tree_steps_through_the_triton_kernels_are_the_torch_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's per-level top-k and the fixed-shape step's greedy walk through their Triton kernels (as on
    CUDA; here interpreted) give the same tokens, drafted and accepted counts as torch, in the eager and
    fixed-shape steps."""
    args, _ = mimic_target()
    prompts = random_prompts(3, args.vocab_size, [17, 3, 25], seed=9)
    spec = TREES[1]
    calls: list[int] = []
    triton_ops = TritonOps()

    def counted(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(k)
        return triton_ops.top_logprobs(logits, k)

    runs = []
    for kernel in (False, True):
        if kernel:
            monkeypatch.setattr(TORCH_OPS, "top_logprobs", counted)
            monkeypatch.setattr(tree_step, "tree_kernels_apply", lambda t: True)
            monkeypatch.setattr(tree_step, "greedy_walk", None)  # the torch walk must not run
        for fixed in (False, True):
            eng = tree_engine(spec)
            if fixed:
                with_tree_step(eng)
            out = eng.generate(prompts, {"max_tokens": 12, "ignore_eos": True})
            runs.append(([c.token_ids for c in out], eng.totals.to_dict()))
    assert len(calls) > 20, "the kernel ran"
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
    assert runs[0][1]["accepted"] > 0


def test_a_width_one_tree_is_the_chain() -> None:
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [17, 3, 25, 9], seed=4)
    stats = []
    for spec in ({"num_draft_tokens": 3}, {"num_draft_tokens": 3, "tree_budget": 3, "tree_width": 1}):
        eng = tree_engine(spec, 4)
        eng.generate(prompts, {"max_tokens": 24})
        stats.append(eng.totals.to_dict())
    assert stats[0] == stats[1]
    assert stats[0]["accepted"] > 0


def test_wider_trees_accept_more() -> None:
    """On the same prompts, a tree of budget 24 accepts more per step than the chain of its depth."""
    args, _ = mimic_target()
    prompts = random_prompts(6, args.vocab_size, [17, 3, 25, 9, 30, 12], seed=6)
    lengths = []
    for spec in ({"num_draft_tokens": 4}, {"num_draft_tokens": 4, "tree_budget": 24, "tree_width": 4}):
        eng = tree_engine(spec)
        eng.generate(prompts, {"max_tokens": 40, "ignore_eos": True})
        lengths.append(eng.totals.acceptance_length)
    assert lengths[1] > lengths[0]


def test_tree_sampling_keeps_the_target_distribution() -> None:
    """The second generated token (the first one a tree verification decides) has the target's distribution
    at temperature 1 (chi-square over 600 requests against target-only sampling)."""
    args, w = mimic_target()
    prompt = random_prompts(1, args.vocab_size, [10], seed=2)[0]
    counts = []
    for spec in (None, {"num_draft_tokens": 2, "tree_budget": 6, "tree_width": 3}):
        eng = tiny_engine(args, w) if spec is None else tree_engine(spec)
        counts.append(second_token_counts(eng, prompt, 600, args.vocab_size))
        if spec is not None:
            assert eng.totals.accepted > 0
    assert same_distribution_pvalue(counts) > 1e-3


def test_tree_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="tree_budget: 30 exceeds the 20 nodes"):
        MTPServeConfig.model_validate({"speculative": {"num_draft_tokens": 2, "tree_budget": 30, "tree_width": 4}})
    with pytest.raises(ValidationError, match="tree_budget: draft trees reuse one MTP module"):
        MTPServeConfig.model_validate({"speculative": {"method": "mtp_vanilla", "tree_budget": 4}})
    with pytest.raises(ValidationError, match="tree_budget"):
        MTPServeConfig.model_validate({"speculative": {"tree_budget": 64}})
    with pytest.raises(ValidationError, match=r"tree_width: .* = 80 frontier rows"):
        MTPServeConfig.model_validate({"speculative": {"num_draft_tokens": 6, "tree_width": 16, "tree_budget": 8}})
    with pytest.raises(ValidationError, match=r"max_num_batched_tokens must be at least speculative\.tree_budget"):
        MTPServeConfig.model_validate(
            {"speculative": {"num_draft_tokens": 4, "tree_budget": 40}, "scheduler": {"max_num_batched_tokens": 16}}
        )
    spec = MTPServeConfig.model_validate({"speculative": {"num_draft_tokens": 3, "tree_budget": 16}}).speculative
    assert (spec.proposed_tokens, spec.scratch_slots) == (16, 8)


def with_tree_step(eng: LLMEngine, max_blocks: int = 16) -> FusedTreeStep:
    """Attach the fixed-shape tree step to a tree engine (eager off CUDA, the function CUDA captures)."""
    drafter = eng.draft
    assert isinstance(drafter, MTPEagleTree)
    runner = eng.target
    step = FusedTreeStep(
        runner.model, runner.cache, drafter, max_batch=8, max_blocks=max_blocks, device="cpu", use_graphs=False
    )
    with_steps(eng, tree=step)
    return step


@pytest.mark.parametrize("spec", TREES)
def test_the_fixed_shape_tree_step_matches_the_eager_one(spec: dict[str, int]) -> None:
    """The step CUDA captures (tree verify, branch KV moves, draft re-run, next trees in fixed shapes) gives
    the eager tree path's tokens and acceptance, and target-only tokens; sampled requests run in it too."""
    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 40, 9, 13], seed=8)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 30})]
    eager = tree_engine(spec)
    assert [c.token_ids for c in eager.generate(prompts, {"max_tokens": 30})] == ref
    fixed = tree_engine(spec)
    step = with_tree_step(fixed)
    assert [c.token_ids for c in fixed.generate(prompts, {"max_tokens": 30})] == ref
    assert step.runs >= 5
    assert fixed.totals.to_dict() == eager.totals.to_dict()
    runs = step.runs
    fixed.generate(prompts[:2], {"max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 1})
    assert step.runs > runs, "the top-k/top-p variant runs in the fixed-shape step"
    blocks = fixed.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_the_fixed_shape_tree_step_samples_the_target_distribution() -> None:
    """Sampling in the fixed-shape tree step (temperature-only variant): the second generated token has the
    target's distribution at temperature 1 (chi-square over 600 requests against target-only)."""
    args, w = mimic_target()
    prompt = random_prompts(1, args.vocab_size, [10], seed=2)[0]
    eng = tree_engine({"num_draft_tokens": 2, "tree_budget": 6, "tree_width": 3})
    step = with_tree_step(eng)
    counts = [second_token_counts(tiny_engine(args, w), prompt, 600, args.vocab_size)]
    counts.append(second_token_counts(eng, prompt, 600, args.vocab_size))
    assert step.runs >= 50 and eng.totals.accepted > 0
    assert same_distribution_pvalue(counts) > 1e-3


def test_sampled_requests_get_a_seed_every_rank_shares() -> None:
    """A sampling request without a seed gets one at admission, so every TP rank walks a tree the same way
    and moves the same KV; greedy requests and given seeds are left alone."""
    eng = tree_engine(TREES[0])
    prompt = [1, 2, 3]
    sampled = eng.add_request(prompt, {"temperature": 0.7})
    seeded = eng.add_request(prompt, {"temperature": 0.7, "seed": 5})
    greedy = eng.add_request(prompt, {})
    seeds = [eng.scheduler.requests[r].params.seed for r in (sampled, seeded, greedy)]
    assert seeds[0] is not None and seeds[1:] == [5, None]


@pytest.mark.slow
def test_smollm2_trees_with_the_shipped_head_are_lossless_and_accept_more() -> None:
    """On the real target with the shipped head (fp32 CPU): tree drafting emits target-only greedy tokens and
    accepts more per step than the chain of the same depth."""
    base = smollm2_engine()
    prompts = [base.encode_prompt(p) for p in CHAT_PROMPTS[:3]]
    ref = [c.token_ids for c in base.generate(prompts, {"max_tokens": 32, "ignore_eos": True})]
    lengths = []
    for spec in ({"num_draft_tokens": 3}, {"num_draft_tokens": 3, "tree_budget": 12, "tree_width": 4}):
        head = MTPEagleHead.load(DEFAULT_HEAD, smollm2()[1])
        eng = smollm2_engine(head, scheduler={"chunk_size": 7, "max_num_batched_tokens": 256}, speculative=spec)
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 32, "ignore_eos": True})] == ref
        lengths.append(eng.totals.acceptance_length)
    assert lengths[1] > lengths[0] > 1.3


def test_tree_buffers_hold_each_trees_depths_and_ancestors() -> None:
    """Filled after trees of other shapes and bucket sizes, the fixed tree buffers hold every real tree's
    depths, parents and ancestor mask as `DraftTree` computes them, and padding rows see only themselves."""
    gen = torch.Generator().manual_seed(3)
    q = 9
    bufs = TreeBuffers(8, q, torch.device("cpu"))
    for n, bucket in [(8, 8), (1, 1), (3, 4), (0, 2), (2, 8), (5, 8)]:
        parents = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q)] for _ in range(n)]
        depths = bufs.fill(np.array(parents, dtype=np.int64).reshape(n, q), bucket)
        for b, p in enumerate(parents):
            tree = DraftTree(torch.arange(q), torch.tensor(p))
            assert depths[b].tolist() == tree.depth().tolist()
            assert bufs.depth[b].tolist() == tree.depth().tolist() and bufs.parents[b].tolist() == p
            assert torch.equal(bufs.mask[b].bool(), tree.ancestor_mask())
        for b in range(n, bucket):
            assert torch.equal(bufs.mask[b], torch.eye(q, dtype=torch.long)), "padding rows see only themselves"
            assert bufs.depth[b].tolist() == [0] * q and bufs.parents[b].tolist() == [-1] + [0] * (q - 1)


def test_a_random_draft_with_a_reduced_vocabulary_scores_only_those_tokens(tmp_path: Path) -> None:
    """`speculative.draft_vocab` restricts a random head's lm_head to the first N ids (every drafted token is
    one of them) and greedy output stays the target's; it is refused for trained heads and past the vocabulary."""
    from mtpserve.cluster.engine.errors import ModelLoadError
    from tests.helpers.tiny import save_model_dir, tiny_args, tiny_weights

    args = tiny_args()
    path = save_model_dir(tmp_path / "m", args, tiny_weights(args))

    def engine(**spec: object) -> LLMEngine:
        cfg = engine_config(model={"path": path}, speculative={"draft": "random", **spec})
        return LLMEngine.from_config(cfg, load_tokenizer=False)

    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 2]]
    params = {"max_tokens": 12, "ignore_eos": True}
    want = [c.token_ids for c in engine(enabled=False).generate(prompts, params)]
    eng = engine(num_draft_tokens=3, tree_budget=6, tree_width=2, draft_vocab=17)
    assert [c.token_ids for c in eng.generate(prompts, params)] == want
    assert eng.draft is not None
    tokens, _, _ = eng.draft.grow_eager(torch.randn(2, args.hidden_size), [1, 1], [[0], [1]])
    assert tokens.shape == (2, 6) and int(tokens.max()) < 17
    with pytest.raises(ValidationError, match="draft_vocab"):
        engine_config(speculative={"draft": "default", "draft_vocab": 17})
    with pytest.raises(ModelLoadError, match="draft_vocab"):
        engine(draft_vocab=10**6)
