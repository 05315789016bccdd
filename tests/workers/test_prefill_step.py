"""The captured prefill step (one request's prompt chunk in fixed shapes), run eagerly on CPU over the same
buffers that CUDA captures: tokens, stats, target KV and draft KV equal the eager path's; padding stays out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.messages import SeqPlan, StepPlan
from mtpserve.speculative.sampling import SamplingMode
from mtpserve.workers.prefill_buffers import PREFILL_SLOTS
from mtpserve.workers.prefill_step import PREFILL_REPLAYS, PREFILL_ROWS, CapturedPrefill, prefill_sizes
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.step_builders import TargetParts, build_prefill
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, slots_of, tiny_engine, with_steps

CHUNK = 20  # buckets 16 and 20: a 3-token prompt pads 13 rows, a 45-token one takes chunks of 20, 20, 5
LENGTHS = [3, 17, 45, 20, 1]


def with_prefill(eng: LLMEngine, k: int) -> tuple[CapturedPrefill, list[tuple[int, int, bool]]]:
    """Give the engine's runner a prefill step (eager over its fixed buffers); returns it and a log of
    (rows, bucket, final) per use."""
    runner = eng.target
    step = CapturedPrefill(
        runner.model,
        runner.cache,
        eng.draft,
        k,
        max_tokens=CHUNK,
        max_blocks=16,
        device="cpu",
        use_graphs=False,  # type: ignore[attr-defined,arg-type]
    )
    with_steps(eng, prefill=step)
    log: list[tuple[int, int, bool]] = []
    orig = step.run

    def spy(plan: StepPlan, bucket: int, uniform: float | None = None) -> Any:
        s = plan.seqs[0]
        log.append((len(s.token_ids), bucket, s.is_final_chunk))
        return orig(plan, bucket, uniform)

    step.run = spy  # type: ignore[method-assign]
    return step, log


def prefill_alone(eng: LLMEngine, prompt: list[int]) -> tuple[str, list[int]]:
    """Run one request's prompt until its first token; returns its id and the token."""
    rid = eng.add_request(prompt, {"max_tokens": 12})
    while True:
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids:
                return rid, list(o.new_token_ids)


def kv_of(eng: LLMEngine, rid: str, n: int) -> list[torch.Tensor]:
    """Target KV of every layer, then the draft's, for positions [0, n) of a running request."""
    req = eng.scheduler.requests[rid]
    caches = [eng.target.cache] + ([eng.draft.cache] if eng.draft is not None else [])  # type: ignore[attr-defined]
    out = []
    for cache in caches:
        slots = slots_of(req.block_ids, cache.block_size, n)
        for layer in range(len(cache.keys)):
            out.extend(t.clone() for t in cache.gather(layer, slots))
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_prefill_step_matches_the_eager_path(k: int) -> None:
    """Prompts of several lengths, each alone: the prefill step (padded buckets, non-final and final
    chunks) gives the eager path's first tokens, KV (target and draft, so the prompt lookahead is
    unchanged) and, decoding on, the same tokens and acceptance; every KV block comes back."""
    args, w = mimic_target()
    head = mimic_head(args, w) if k else None
    spec = {"num_draft_tokens": max(k, 1)}
    sched = {"chunk_size": CHUNK, "max_num_batched_tokens": 64}
    prompts = random_prompts(len(LENGTHS), args.vocab_size, LENGTHS, seed=5)
    ref = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    eng = tiny_engine(args, w, head, speculative=spec, scheduler=sched)
    _, log = with_prefill(eng, k)
    for p in prompts:
        r1, t1 = prefill_alone(ref, p)
        r2, t2 = prefill_alone(eng, p)
        assert t1 == t2
        for a, b in zip(kv_of(ref, r1, len(p)), kv_of(eng, r2, len(p)), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        if k:
            assert eng.scheduler.requests[r2].draft_token_ids == ref.scheduler.requests[r1].draft_token_ids
        while ref.has_unfinished():
            ref.step()
        while eng.has_unfinished():
            eng.step()
    assert any(n < bucket for n, bucket, _ in log), log  # padded rows ran
    assert any(not final for *_, final in log) and any(final for *_, final in log)
    assert len(log) == sum(-(-n // CHUNK) for n in LENGTHS)  # every chunk of every prompt went through it
    assert eng.totals.accepted == ref.totals.accepted and eng.totals.drafted == ref.totals.drafted
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_generation_through_the_prefill_step_is_unchanged() -> None:
    """Whole requests, one at a time, with the prefill step: the same completions as without it."""
    args, w = mimic_target(seed=3)
    head = mimic_head(args, w)
    sched = {"chunk_size": CHUNK}
    prompts = random_prompts(4, args.vocab_size, [30, 2, 19, 41], seed=9)
    ref = tiny_engine(args, w, head, scheduler=sched)
    eng = tiny_engine(args, w, head, scheduler=sched)
    _, log = with_prefill(eng, 3)
    for p in prompts:
        want = ref.generate([p], {"max_tokens": 16})[0].token_ids
        assert eng.generate([p], {"max_tokens": 16})[0].token_ids == want
    assert log


@pytest.mark.parametrize("k", [0, 3])
def test_sampling_prompts_alone_draw_as_the_eager_path(k: int) -> None:
    """Seeded sampling requests, one at a time (temperature only, and with top-k/top-p), get the eager
    path's first token and completion: the same draw from the request's generator, in fixed buffers."""
    args, w = mimic_target(seed=4)
    head = mimic_head(args, w) if k else None
    sched = {"chunk_size": CHUNK}
    prompts = random_prompts(4, args.vocab_size, [12, 30, 3, 21], seed=3)
    params: list[dict[str, Any]] = [
        {"max_tokens": 10, "temperature": 0.9, "seed": 1},
        {"max_tokens": 10, "temperature": 1.3, "top_k": 4, "seed": 2},
        {"max_tokens": 10, "temperature": 0.7, "top_p": 0.8, "seed": 3},
        {"max_tokens": 10, "temperature": 1.0, "seed": 4},
    ]
    ref = tiny_engine(args, w, head, scheduler=sched)
    eng = tiny_engine(args, w, head, scheduler=sched)
    _, log = with_prefill(eng, max(k, 1) if k else 0)
    for p, q in zip(prompts, params, strict=True):
        assert eng.generate([p], q)[0].token_ids == ref.generate([p], q)[0].token_ids
    assert sum(final for *_, final in log) == len(prompts)


def test_padding_rows_write_only_the_scratch_block_and_stay_finite() -> None:
    """A 3-token chunk in a 16-row bucket: the 13 padding rows leave every other block untouched and the
    scratch block finite, in the target's cache and the draft's."""
    args, w = mimic_target()
    eng = tiny_engine(args, w, mimic_head(args, w), scheduler={"chunk_size": CHUNK})
    _, log = with_prefill(eng, 3)
    held: list[int] = []
    assert eng.scheduler.blocks.grow(held, 24)  # the first blocks belong to someone else
    caches = [eng.target.cache.stacked, eng.draft.cache.stacked]  # type: ignore[attr-defined]
    for c in caches:
        c.normal_()  # any finite content; untouched blocks must keep it
    before = [c.clone() for c in caches]
    rid, _ = prefill_alone(eng, random_prompts(1, args.vocab_size, [3], seed=2)[0])
    assert log == [(3, 16, True)]
    req = eng.scheduler.requests[rid]
    scratch = eng.target.cache.scratch_block  # type: ignore[attr-defined]
    for c, c0 in zip(caches, before, strict=True):
        assert not set(req.block_ids) & set(held)
        written = set(req.block_ids) | {scratch}
        for b in range(c.shape[2]):
            if b not in written:
                assert torch.equal(c[:, :, b], c0[:, :, b]), b
        assert torch.isfinite(c[:, :, scratch]).all()


def plan_of(*seqs: SeqPlan) -> StepPlan:
    """A step plan of the given rows."""
    return StepPlan(step_id=1, seqs=list(seqs), num_draft_tokens=3)


def chunk(n: int, **over: Any) -> SeqPlan:
    """A final prompt chunk of n tokens."""
    fields: dict[str, Any] = dict(
        request_id="r", token_ids=list(range(n)), start=0, block_ids=[0, 1, 2, 3], is_context=True,
        is_final_chunk=True, lookahead_token=-1,
    )  # fmt: skip
    fields.update(over)
    return SeqPlan(**fields)


def test_which_steps_take_the_prefill_step() -> None:
    """Prompt chunks that fit one replay (greedy or sampling, up to PREFILL_SLOTS of them) take the smallest
    bucket that holds their rows together; anything else (generation rows, a draft tree, too many rows, chunks
    or blocks) does not. More chunks split, in order, into at most PREFILL_REPLAYS replays."""
    assert prefill_sizes(512) == [16, 32, 64, 128, 256, 512] and prefill_sizes(20) == [16, 20]
    assert prefill_sizes(6) == [6]
    args, w = mimic_target()
    eng = tiny_engine(args, w, mimic_head(args, w), scheduler={"chunk_size": CHUNK})
    step, _ = with_prefill(eng, 3)
    assert step.bucket_for(plan_of(chunk(1))) == 16 and step.bucket_for(plan_of(chunk(17))) == 20
    assert step.bucket_for(plan_of(chunk(21))) is None
    assert step.bucket_for(plan_of(chunk(4), chunk(4, request_id="s"))) == 16
    assert step.bucket_for(plan_of(chunk(12), chunk(4, request_id="s"), chunk(3, request_id="t"))) == 20
    assert step.bucket_for(plan_of(chunk(12), chunk(12, request_id="s"))) is None
    assert step.bucket_for(plan_of(*[chunk(1, request_id=str(i)) for i in range(PREFILL_SLOTS + 1)])) is None
    assert step.groups([chunk(12), chunk(4), chunk(9), chunk(20), chunk(1)]) == [
        ([0, 1], 16), ([2], 16), ([3], 20), ([4], 16)
    ]  # fmt: skip
    assert step.groups([chunk(1)] * (PREFILL_SLOTS + 1)) == [(list(range(PREFILL_SLOTS)), 16), ([PREFILL_SLOTS], 16)]
    assert step.groups([chunk(12)] * (PREFILL_REPLAYS + 1)) is None
    assert step.groups([chunk(4), chunk(4, is_context=False)]) is None
    assert step.bucket_for(plan_of(chunk(4, is_context=False))) is None
    assert step.bucket_for(plan_of(chunk(4, temperature=0.8, top_p=0.9))) == 16
    assert step.bucket_for(plan_of(chunk(4, draft_parents=[-1, 0, 0, 1]))) is None
    assert step.bucket_for(plan_of(chunk(4, block_ids=list(range(17))))) is None


def parts(eng: LLMEngine) -> TargetParts:
    """What an in-process engine's target steps run over."""
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    return TargetParts(runner.model, runner.cache, runner.device)


def test_build_prefill_applies_only_where_it_is_exact() -> None:
    """The builder gives the step for target-only and MTP Eagle chain engines, and none when it is turned
    off, under `sampled` lookahead, or for another draft method (a tree)."""
    args, w = mimic_target()
    head = mimic_head(args, w)
    chain_eng = tiny_engine(args, w, head)
    base = chain_eng.cfg
    step = build_prefill(base, parts(chain_eng), chain_eng.draft, 3, max_len=64)  # type: ignore[arg-type]
    assert isinstance(step, CapturedPrefill) and step.chain is chain_eng.draft
    sched = base.scheduler  # one replay takes PREFILL_ROWS rows (or a chunk, if longer) within the token budget
    assert step.sizes == prefill_sizes(min(max(sched.chunk_size, PREFILL_ROWS), sched.max_num_batched_tokens))
    off = base.model_copy(update={"model": base.model.model_copy(update={"prefill_graphs": False})})
    assert build_prefill(off, parts(chain_eng), chain_eng.draft, 3, max_len=64) is None  # type: ignore[arg-type]
    sampled = base.model_copy(
        update={"speculative": base.speculative.model_copy(update={"lookahead_source": "sampled"})}
    )
    assert build_prefill(sampled, parts(chain_eng), chain_eng.draft, 3, max_len=64) is None  # type: ignore[arg-type]
    tree_eng = tiny_engine(args, w, head, speculative={"tree_budget": 6, "tree_width": 2})
    assert build_prefill(tree_eng.cfg, parts(tree_eng), tree_eng.draft, 3, max_len=64) is None  # type: ignore[arg-type]
    plain = tiny_engine(args, w)
    step = build_prefill(plain.cfg, parts(plain), None, 0, max_len=64)  # type: ignore[arg-type]
    assert isinstance(step, CapturedPrefill) and step.chain is None


def test_capture_warm_ups_read_a_real_chunk() -> None:
    """Before capturing, the buffers hold a one-token sampled chunk on the scratch block: warm-up runs
    attend over a key at a positive temperature, so no NaN logits reach the steps that index with tokens."""
    args, w = mimic_target()
    eng = tiny_engine(args, w, mimic_head(args, w), scheduler={"chunk_size": CHUNK})
    step = CapturedPrefill(
        eng.target.model, eng.target.cache, eng.draft, 3, max_tokens=CHUNK, max_blocks=8, device="cpu"
    )  # type: ignore[arg-type]
    step.capture()
    b = step.buffers
    assert (b.last_row[0].item(), b.q_len[0].item()) == (0, step.sizes[0])
    assert b.q_len[1:].eq(0).all() and b.last_row.eq(0).all() and b.source.eq(0).all()  # unused slots repeat slot 0
    assert b.seq_len[0].item() >= 1 and b.sampling()[0].gt(0).all()
    scratch = eng.target.cache.scratch_block  # type: ignore[attr-defined]
    assert set(b.slot_mapping[: step.sizes[0]].div(b.block_size, rounding_mode="floor").tolist()) == {scratch}
    for bucket in step.sizes[:2]:
        for mode in SamplingMode:
            assert torch.isfinite(step._forward(bucket, mode, final=True).float()).all()


def test_chunks_in_one_replay_write_the_eager_kv_and_drafts() -> None:
    """Three prompt chunks in one replay (final, non-final with its next prompt token as lookahead, final; the
    last padded) give the eager step's first tokens, drafts, target KV and draft KV: each chunk's last row
    reads its own lookahead entry."""
    args, w = mimic_target(seed=6)
    head = mimic_head(args, w)
    ref = tiny_engine(args, w, head, scheduler={"chunk_size": CHUNK})
    eng = tiny_engine(args, w, head, scheduler={"chunk_size": CHUNK})
    _, log = with_prefill(eng, 3)
    a, b, c = random_prompts(3, args.vocab_size, [6, 9, 3], seed=3)
    seqs = [
        chunk(6, request_id="a", token_ids=a, block_ids=[1]),
        chunk(5, request_id="b", token_ids=b[:5], block_ids=[2], is_final_chunk=False, lookahead_token=b[5]),
        chunk(3, request_id="c", token_ids=c, block_ids=[3]),
    ]
    plan = plan_of(*seqs)
    want = ref.target.execute(plan)
    assert want.draft_inputs is not None and ref.draft is not None
    want_drafts = ref.draft.propose(want.draft_inputs)
    got = eng.target.execute(plan)
    assert log == [(6, 16, True)]  # one replay of all three chunks (the spy logs the first)
    assert [r.new_token_ids for r in got.results] == [r.new_token_ids for r in want.results]
    assert [r.new_token_ids for r in got.results][1] == []  # a non-final chunk reports no token
    assert got.draft_outputs is not None and got.draft_outputs.request_ids == ["a", "c"]
    assert got.draft_outputs.draft_token_ids.tolist() == want_drafts.draft_token_ids.tolist()
    for s in seqs:
        caches = [ref.target.cache, eng.target.cache, ref.draft.cache, eng.draft.cache]  # type: ignore[attr-defined]
        slots = slots_of(s.block_ids, caches[0].block_size, len(s.token_ids))
        for r, e in (caches[:2], caches[2:]):
            for layer in range(len(r.keys)):
                for x, y in zip(r.gather(layer, slots), e.gather(layer, slots), strict=True):
                    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
