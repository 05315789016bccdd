"""Context-chunk scheduler driven by a fake model output."""

from __future__ import annotations

import random
from typing import Any

import pytest

from mtpserve.cluster.engine.request import Request
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.engine.scheduler import Scheduler
from mtpserve.speculative.messages import DraftOutputs, SeqResult, StepPlan, TargetOutput
from mtpserve.workers.config import SchedulerConfig
from tests.helpers.tiny import random_prompts, tiny_args, tiny_engine, tiny_weights


class FakeTarget:
    """Emits token (sum of the sequence so far) % 50 + 1 at each sampled row; records every plan."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []
        self.sequences: dict[str, list[int]] = {}

    def execute(self, plan: StepPlan) -> TargetOutput:
        self.plans.append(plan)
        results = []
        for s in plan.seqs:
            seq = self.sequences.setdefault(s.request_id, [])
            if s.start == 0:
                seq.clear()
            del seq[s.start :]
            seq.extend(s.token_ids)
            new = [sum(seq) % 50 + 1] if s.is_final_chunk else []
            results.append(SeqResult(s.request_id, new))
        return TargetOutput(plan.step_id, results)


def run(sched: Scheduler, fake: FakeTarget, max_steps: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        for o in sched.update(plan, fake.execute(plan), None):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not sched.has_unfinished()
    return out


def make(
    budget: int = 16, chunk: int = 5, blocks: int = 64, k: int = 0, max_requests: int = 4, caching: bool = True
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        chunk_size=chunk,
        max_num_requests=max_requests,
        block_size=4,
        prefix_caching=caching,
    )
    return Scheduler(cfg, blocks, k, eos_token_ids=[], max_model_len=1000)


def test_budget_coverage_and_final_flags() -> None:
    sched, fake = make(), FakeTarget()
    prompts = random_prompts(6, 90, [13, 1, 4, 22, 5, 9], seed=1)
    for i, p in enumerate(prompts):
        sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=6)))
    out = run(sched, fake)
    assert all(len(out[f"r{i}"]) == 6 for i in range(6))
    covered: dict[str, list[int]] = {}
    for plan in fake.plans:
        assert plan.num_tokens <= 16
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
        for s in plan.seqs:
            if not s.is_context:
                continue
            got = covered.setdefault(s.request_id, [])
            assert s.start == len(got), "context chunks must be contiguous and in order"
            got.extend(s.token_ids)
            prompt = prompts[int(s.request_id[1:])]
            assert s.is_final_chunk == (s.end == len(prompt))
            assert s.lookahead_token == (-1 if s.is_final_chunk else prompt[s.end])
    for i, p in enumerate(prompts):
        assert covered[f"r{i}"] == p, "every prompt token is computed exactly once, in order"
    assert sched.blocks.num_free == 64


def test_continuous_batching_admits_between_steps() -> None:
    sched, fake = make(), FakeTarget()
    sched.add(Request("a", [1] * 20, SamplingParams(max_tokens=30)))
    for _ in range(6):
        plan = sched.schedule()
        sched.update(plan, fake.execute(plan), None)
    sched.add(Request("b", [2] * 3, SamplingParams(max_tokens=3)))
    plan = sched.schedule()
    assert {s.request_id for s in plan.seqs} == {"a", "b"}
    sched.update(plan, fake.execute(plan), None)
    run(sched, fake)


def test_preemption_frees_blocks_and_resume_recomputes_identically() -> None:
    prompts = random_prompts(4, 90, [15, 11, 19, 7], seed=2)
    ref_sched, ref_fake = make(blocks=200), FakeTarget()
    for i, p in enumerate(prompts):
        ref_sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=20)))
    ref = run(ref_sched, ref_fake)
    sched, fake = make(blocks=16), FakeTarget()
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    free_seen = []
    out: dict[str, list[int]] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        held = sum(len(r.block_ids) for r in sched.running)
        assert held + sched.blocks.num_free == 16, "blocks are held by running requests or free, never lost"
        for o in sched.update(plan, fake.execute(plan), None):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        free_seen.append(sched.blocks.num_free)
    assert sum(r.num_preemptions for r in reqs) > 0, "the small cache must force preemption"
    assert out == ref
    assert sched.blocks.num_free == 16


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_context_recomputes_prompt_plus_output(caching: bool) -> None:
    sched, fake = make(blocks=200, chunk=4, caching=caching), FakeTarget()
    req = Request("x", list(range(1, 10)), SamplingParams(max_tokens=5))
    sched.add(req)
    while len(req.output_token_ids) < 2:
        plan = sched.schedule()
        sched.update(plan, fake.execute(plan), None)
    sched.preempt(req)
    assert req.block_ids == [] and req.num_computed_tokens == 0 and req.in_context
    plan = sched.schedule()
    (s,) = plan.seqs
    # 11 known tokens, blocks of 4: with caching the two full blocks (their next tokens known) are reused
    start = 8 if caching else 0
    assert s.is_context and s.start == start and s.token_ids == req.all_token_ids[start : start + 4]
    assert s.is_final_chunk == caching and s.lookahead_token == (-1 if caching else req.all_token_ids[4])


def test_speculative_slots_and_drafts_are_planned() -> None:
    sched, fake = make(k=3), FakeTarget()
    sched.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=8)))
    plan = sched.schedule()
    out = fake.execute(plan)
    sched.update(plan, out, DraftOutputs(plan.step_id, ["a"], __import__("torch").tensor([[1, 2, 3]])))
    plan = sched.schedule()
    (s,) = plan.seqs
    assert not s.is_context and s.token_ids[1:] == [1, 2, 3] and s.num_draft_tokens == 3
    assert len(sched.requests["a"].block_ids) * 4 >= s.end + 3


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_never_leaks(seed: int) -> None:
    rng = random.Random(seed)
    sched, fake = make(budget=rng.randint(4, 20), chunk=rng.randint(1, 8), blocks=40), FakeTarget()
    n = 12
    for i in range(n):
        p = [rng.randrange(1, 90) for _ in range(rng.randint(1, 30))]
        sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(1, 12))))
    aborted = {"r3", "r7"}
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, fake.execute(plan), None)
    for rid in aborted:
        sched.abort(rid)
    out = run(sched, fake)
    assert set(out) | aborted >= {f"r{i}" for i in range(n)} - aborted
    assert sched.blocks.num_free == 40


def test_real_engine_preemption_resume_matches_unpreempted() -> None:
    args = tiny_args()
    w = tiny_weights(args)
    prompts = random_prompts(4, args.vocab_size, [30, 25, 18, 33], seed=9)
    ref = [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": 24})]
    eng = tiny_engine(args, w, scheduler={"num_kv_blocks": 14, "chunk_size": 7, "max_num_batched_tokens": 20})
    got = eng.generate(prompts, {"max_tokens": 24})
    assert eng.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == ref
    assert eng.scheduler.blocks.num_free == 14


def test_a_steps_tokens_reach_on_tokens_before_its_draft_proposes() -> None:
    """With `on_tokens` set (the engine loop sets it), a step's tokens are handed over before the in-process
    draft runs, and nothing is lost or repeated: the tokens equal those `step()` returns without it."""
    from tests.helpers.tiny import mimic_head, mimic_target

    args, w = mimic_target()
    prompts = random_prompts(3, args.vocab_size, [9, 14, 21], seed=4)
    sched = {"chunk_size": 5}
    ref = [
        c.token_ids
        for c in tiny_engine(args, w, mimic_head(args, w), scheduler=sched).generate(prompts, {"max_tokens": 7})
    ]
    eng = tiny_engine(args, w, mimic_head(args, w), scheduler=sched)
    events: list[tuple[str, int]] = []
    got: dict[str, list[int]] = {}

    def on_tokens(outs: list) -> None:
        events.append(("tokens", step))
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    propose = eng.draft.propose  # type: ignore[union-attr]

    def observed(inputs: Any) -> Any:
        events.append(("draft", step))
        return propose(inputs)

    eng.on_tokens = on_tokens
    eng.draft.propose = observed  # type: ignore[union-attr,method-assign]
    rids = [eng.add_request(p, {"max_tokens": 7}) for p in prompts]
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            assert not o.new_token_ids, "tokens go to on_tokens"
        step += 1
    assert [got[r] for r in rids] == ref
    with_tokens = {s for kind, s in events if kind == "tokens"}
    assert with_tokens and all(events.index(("tokens", s)) < events.index(("draft", s)) for s in with_tokens)


def _expected_stream(
    tokens: list[int], params: SamplingParams, eos: set[int], room: int
) -> tuple[list[int], str | None]:
    """A step's emitted tokens and finish reason, token by token: stop at the first stop token (EOS
    unless ignored), else at max_tokens or the model length (`room` tokens left before either)."""
    out: list[int] = []
    for t in tokens:
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out, "stop"
        if len(out) >= room:
            return out, "length"
    return out, None


@pytest.mark.parametrize("seed", range(4))
def test_multi_token_steps_stop_where_token_by_token_would(seed: int) -> None:
    """Speculative steps emit 1-4 tokens at once; whatever the mix of stop tokens, EOS (ignored or not),
    max_tokens and max_model_len, a request emits exactly the tokens up to its first stop condition."""
    rng = random.Random(seed)
    for trial in range(40):
        cfg = SchedulerConfig(max_num_batched_tokens=64, chunk_size=16, max_num_requests=4, block_size=4)
        max_len = rng.randint(12, 30)
        sched = Scheduler(cfg, 64, 3, eos_token_ids=[2], max_model_len=max_len)
        params = SamplingParams(
            max_tokens=rng.randint(1, 12), stop_token_ids=rng.choice([[], [3], [3, 4]]), ignore_eos=rng.random() < 0.5
        )
        prompt = [rng.randint(5, 40) for _ in range(rng.randint(1, 8))]
        sched.add(Request(f"r{trial}", prompt, params))
        emitted: list[int] = []
        reason = None
        plan = sched.schedule()
        while sched.has_unfinished():
            (s,) = plan.seqs
            tokens = [rng.choice([2, 3, 4, 9, 10, 11, 12]) for _ in range(1 if s.is_context else rng.randint(1, 4))]
            room = min(params.max_tokens - len(emitted), max_len - len(prompt) - len(emitted))
            want = _expected_stream(tokens, params, {2}, room)
            (o,) = sched.update(plan, TargetOutput(plan.step_id, [SeqResult(s.request_id, tokens, 0, 0)]), None)
            assert (o.new_token_ids, o.finish_reason) == want, f"trial {trial}: {tokens} with room {room}"
            emitted += o.new_token_ids
            reason = o.finish_reason
            plan = sched.schedule()
        assert reason is not None and sched.blocks.num_free == 64, "the request finished and gave its blocks back"


def test_default_budget_fits_a_full_decode_batch_with_its_drafts_and_a_prompt_chunk() -> None:
    """Unset, the token budget is max_num_requests x (K + 1) + max(chunk_size, 8192): 255 requests at K=3 decode
    together in one step, and a new prompt still gets a whole chunk beside them."""
    from mtpserve.workers.config import PREFILL_SHARE, MTPServeConfig

    assert PREFILL_SHARE == 8192
    cfg = MTPServeConfig(scheduler={"max_num_requests": 256})
    assert cfg.scheduler.max_num_batched_tokens == 256 * 4 + 8192
    assert MTPServeConfig(speculative={"enabled": False}).scheduler.max_num_batched_tokens == 64 + 8192
    assert MTPServeConfig(speculative={"tree_budget": 15}).scheduler.max_num_batched_tokens == 64 * 16 + 8192
    big_chunks = MTPServeConfig(scheduler={"chunk_size": 10_000})
    assert big_chunks.scheduler.max_num_batched_tokens == 64 * 4 + 10_000
    assert MTPServeConfig(scheduler={"max_num_batched_tokens": 300}).scheduler.max_num_batched_tokens == 300

    torch = pytest.importorskip("torch")
    sched = Scheduler(cfg.scheduler, 4096, 3, eos_token_ids=[], max_model_len=4096)
    fake = FakeTarget()
    ids = [f"r{i}" for i in range(255)]  # and one slot left for a prompt
    for rid in ids:
        sched.add(Request(rid, [7, 8, 9], SamplingParams(max_tokens=100, ignore_eos=True)))
    plan = sched.schedule()
    assert len(plan.seqs) == 255  # every prompt in one step
    sched.update(plan, fake.execute(plan), DraftOutputs(plan.step_id, ids, torch.ones(255, 3, dtype=torch.long)))
    sched.add(Request("long", list(range(1, 2001)), SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    gen = [s for s in plan.seqs if not s.is_context]
    ctx = [s for s in plan.seqs if s.is_context]
    assert len(gen) == 255 and all(len(s.token_ids) == 4 for s in gen)
    assert [len(s.token_ids) for s in ctx] == [512]
