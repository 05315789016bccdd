"""Logic behind CUDA-graph replay, run eagerly on CPU: fixed buffers, padding, buckets, equal outputs."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.sampling import SamplingMode
from mtpserve.workers.graph_runner import CapturedSteps, pick_bucket
from mtpserve.workers.step_buffers import StepBuffers
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine, with_steps, with_uniform


def test_pick_bucket() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert pick_bucket(17, sizes) is None


def test_fill_pads_onto_scratch_block() -> None:
    buf = StepBuffers.allocate(8, 3, 4, block_size=4, scratch_block=99, device=torch.device("cpu"))
    buf.fill([[5, 6, 7], [8, 9, 10]], starts=[5, 0], tables=[[3, 1], [2]], bucket=4)
    assert buf.input_ids[:12].tolist() == [5, 6, 7, 8, 9, 10] + [0] * 6
    assert buf.positions[:6].tolist() == [5, 6, 7, 0, 1, 2]
    assert buf.slot_mapping[:6].tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 8, 9, 10]
    assert (buf.slot_mapping[6:12] // 4 == 99).all(), "padding rows write only the scratch block"
    assert buf.seq_lens[:4].tolist() == [8, 3, 3, 3]
    assert buf.block_tables[0, :2].tolist() == [3, 1] and buf.block_tables[1, :1].tolist() == [2]
    assert buf.block_tables[2:4, 0].tolist() == [99, 99], "padding rows read the scratch block (entries past a"
    # request's blocks are never read, and are left as they were)
    ptrs = buf.addresses()
    first = buf.turn
    buf.fill([[1, 2, 3]], starts=[4], tables=[[7, 6]], bucket=1)  # a smaller step after a larger one
    assert buf.turn != first and buf.stagings[first][:6].tolist() == [5, 6, 7, 8, 9, 10], (
        "a step leaves the previous step's host twin alone: its copy may still be queued"
    )
    assert buf.input_ids[:3].tolist() == [1, 2, 3] and buf.slot_mapping[:3].tolist() == [6 * 4, 6 * 4 + 1, 6 * 4 + 2]
    assert buf.seq_lens[:1].tolist() == [7] and buf.block_tables[0, :2].tolist() == [7, 6]
    assert buf.addresses() == ptrs
    base, size = buf.packed.data_ptr(), buf.packed.numel() * 8
    assert all(base <= a < base + size for a in ptrs[:5]), "every index field is a view of the packed buffer"
    fbase, fsize = buf.fpacked.data_ptr(), buf.fpacked.numel() * 4
    assert all(fbase <= a < fbase + fsize for a in ptrs[5:]), "sampling fields are views of the float buffer"
    with pytest.raises(ValueError):
        buf.fill([[1, 2]], [0], [[0]], bucket=1)
    with pytest.raises(ValueError):
        buf.fill([[1, 2, 3]] * 3, [0] * 3, [[0]] * 3, bucket=2)


def test_captured_steps_fall_back_to_eager_off_cuda() -> None:
    calls: list[int] = []
    steps = CapturedSteps(lambda b: calls.append(b) or b, [1, 4], torch.device("cpu"))
    steps.capture()
    assert steps.graphs == {} and steps.run(4) == 4 and calls == [4]


def test_failed_capture_falls_back_to_eager() -> None:
    """A variant that cannot be captured (here: no CUDA at all) keeps working eagerly on its buffers."""
    calls: list[int] = []
    steps = CapturedSteps(lambda b: calls.append(b) or b * 10, [1, 2], torch.device("cuda"))
    assert steps.enabled
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA to make capture fail")
    assert steps.try_capture() is False
    assert not steps.enabled and steps.graphs == {}
    assert steps.run(2) == 20 and calls[-1] == 2


@pytest.mark.parametrize("k", [0, 3])
def test_uniform_step_matches_eager_and_keeps_addresses(k: int) -> None:
    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 9, 13, 30], seed=7)
    head = mimic_head(args, w) if k else None
    ref = tiny_engine(args, w, head, speculative={"num_draft_tokens": max(k, 1)})
    want = [c.token_ids for c in ref.generate(prompts, {"max_tokens": 24})]
    eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": max(k, 1)})
    uniform = with_uniform(eng, k)
    ptrs = uniform.buffers.addresses()
    look = eng.draft.lookahead.tokens.data_ptr() if eng.draft is not None else None  # type: ignore[attr-defined]
    used = []
    orig = uniform.run

    def spy(plan, bucket, thresholds, tokens_from=None):  # type: ignore[no-untyped-def]
        used.append((len(plan.seqs), bucket))
        return orig(plan, bucket, thresholds, tokens_from)

    uniform.run = spy  # type: ignore[method-assign]
    got = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 24})]
    assert got == want
    assert used, "generation steps must take the fixed-buffer path"
    assert any(n < b for n, b in used), "some steps must be padded up to a bucket"
    assert uniform.buffers.addresses() == ptrs
    if look is not None:
        assert eng.draft.lookahead.tokens.data_ptr() == look  # type: ignore[attr-defined]
        chain = eng.draft
        bufs = [chain.token_buf.data_ptr(), chain.position_buf.data_ptr(), chain.hidden_buf.data_ptr()]  # type: ignore[attr-defined]
        eng.generate(prompts[:2], {"max_tokens": 6})
        assert [chain.token_buf.data_ptr(), chain.position_buf.data_ptr(), chain.hidden_buf.data_ptr()] == bufs  # type: ignore[attr-defined]


@pytest.mark.parametrize("k", [1, 3])
def test_fused_greedy_step_matches_unfused(k: int) -> None:
    from mtpserve.workers.fused_step import FusedSpecStep

    args, w = mimic_target()
    prompts = random_prompts(6, args.vocab_size, [21, 1, 9, 13, 30, 4], seed=8)
    head = mimic_head(args, w)
    ref = tiny_engine(args, w, head, speculative={"num_draft_tokens": k}, scheduler={"chunk_size": 6})
    want = [c.token_ids for c in ref.generate(prompts, {"max_tokens": 30})]
    eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": k}, scheduler={"chunk_size": 6})
    runner = eng.target
    fused = FusedSpecStep(
        runner.model, runner.cache, eng.draft, k, max_batch=8, max_blocks=12, device="cpu", use_graphs=False
    )  # type: ignore[attr-defined,arg-type]
    with_steps(eng, chain=fused)
    ptrs = fused.buffers.addresses()
    runs = []
    orig = fused.launch

    def spy(plan, bucket, thresholds=None, after=None):  # type: ignore[no-untyped-def]
        runs.append((len(plan.seqs), bucket))
        return orig(plan, bucket, thresholds, after)

    fused.launch = spy  # type: ignore[method-assign]
    out = eng.generate(prompts, {"max_tokens": 30})
    assert [c.token_ids for c in out] == want
    assert eng.totals.accepted == ref.totals.accepted and eng.totals.drafted == ref.totals.drafted
    assert runs and any(n < b for n, b in runs)
    assert fused.buffers.addresses() == ptrs


MIXED = [
    {"max_tokens": 20, "temperature": 0.9, "seed": 11},
    {"max_tokens": 20},
    {"max_tokens": 20, "temperature": 1.2, "top_k": 5, "seed": 12},
    {"max_tokens": 20, "temperature": 0.7, "top_p": 0.8, "seed": 13},
    {"max_tokens": 20, "temperature": 1.0, "top_k": 3, "top_p": 0.9, "seed": 14},
]
TEMPERATURE_ONLY = [  # sampling without top-k/top-p: the variant that skips sorting the vocabulary
    {"max_tokens": 20, "temperature": 0.9, "seed": 11},
    {"max_tokens": 20},
    {"max_tokens": 20, "temperature": 1.2, "seed": 12},
    {"max_tokens": 20, "temperature": 0.7, "seed": 13},
    {"max_tokens": 20, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 14},
]


def run_mixed(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]] = MIXED) -> list[list[int]]:
    """Requests with their own sampling parameters, batched together; tokens per request."""
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[r] for r in ids]


@pytest.mark.parametrize(
    ("fused", "mode"), [(False, "filtered"), (True, "filtered"), (False, "temperature"), (True, "temperature")]
)
def test_sampled_steps_in_fixed_buffers_match_eager(fused: bool, mode: str) -> None:
    """Sampling and greedy requests batched together take the fixed-buffer step of their sampling mode
    (sampling parameters and thresholds copied into fixed buffers) and emit exactly the eager path's tokens
    for the same seeds: with top-k/top-p, and with temperature only (no sort over the vocabulary)."""
    from mtpserve.workers.fused_step import FusedSpecStep

    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 9, 13, 30], seed=9)
    head = mimic_head(args, w)
    ref = tiny_engine(args, w, head, speculative={"num_draft_tokens": 3})
    params = MIXED if mode == "filtered" else TEMPERATURE_ONLY
    want = run_mixed(ref, prompts, params)
    eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": 3})
    runner = eng.target
    step: FusedSpecStep | UniformTargetStep
    if fused:
        step = FusedSpecStep(
            runner.model, runner.cache, eng.draft, 3, max_batch=8, max_blocks=12, device="cpu", use_graphs=False
        )  # type: ignore[attr-defined,arg-type]
        with_steps(eng, chain=step)
    else:
        step = with_uniform(eng, 3)
    ptrs = step.buffers.addresses()
    sampled_calls = []
    variant = step.steps.variants[SamplingMode(mode)]
    orig = variant.run

    def spy(bucket):  # type: ignore[no-untyped-def]
        sampled_calls.append(bucket)
        return orig(bucket)

    variant.run = spy  # type: ignore[method-assign]
    got = run_mixed(eng, prompts, params)
    assert got == want
    assert sampled_calls, "steps with sampling requests must take the fixed-buffer path of their mode"
    assert step.buffers.addresses() == ptrs
    greedy = tiny_engine(args, w, head).generate(prompts[:1], {"max_tokens": 20})[0].token_ids
    assert (
        got[0] != greedy
        and got[1] == tiny_engine(args, w, head).generate(prompts[1:2], {"max_tokens": 20})[0].token_ids
    )
    assert eng.totals.accepted == ref.totals.accepted and eng.totals.drafted == ref.totals.drafted


@pytest.mark.parametrize("k", [1, 3])
def test_uniform_chain_step_matches_eager_chain(k: int) -> None:
    """The captured chain (separate draft worker / TP rank 0) proposes exactly what the eager chain does:
    same tokens, same acceptance, greedy and sampling requests, with fixed buffer addresses."""
    from mtpserve.workers.chain_step import UniformChainStep

    args, w = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [21, 1, 9, 13, 30], seed=10)
    head = mimic_head(args, w)
    ref = tiny_engine(args, w, head, speculative={"num_draft_tokens": k})
    want = run_mixed(ref, prompts)
    eng = tiny_engine(args, w, head, speculative={"num_draft_tokens": k})
    chain = eng.draft
    step = UniformChainStep(chain, k, 8, 12, use_graphs=False)  # type: ignore[arg-type]
    chain.uniform = step  # type: ignore[attr-defined]
    ptrs = [*step.buffers.addresses(), step.hidden.data_ptr(), step.num_accepted.data_ptr()]
    runs = []
    orig = step.run

    def spy(inputs, bucket):  # type: ignore[no-untyped-def]
        runs.append((len(inputs.request_ids), bucket, max(inputs.seq_lens)))
        return orig(inputs, bucket)

    step.run = spy  # type: ignore[method-assign]
    got = run_mixed(eng, prompts)
    assert got == want
    assert eng.totals.accepted == ref.totals.accepted and eng.totals.drafted == ref.totals.drafted
    assert runs and any(n < b for n, b, _ in runs), "some steps are padded up to a bucket"
    assert any(rows < k + 1 for _, _, rows in runs), "some requests bring fewer rows than K + 1"
    assert [*step.buffers.addresses(), step.hidden.data_ptr(), step.num_accepted.data_ptr()] == ptrs


def test_fill_names_the_sequence_that_does_not_fit() -> None:
    """A sequence with the wrong row count or too many blocks is refused with its index."""
    buf = StepBuffers.allocate(8, 3, 4, block_size=4, scratch_block=99, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="sequence 1 has 2 rows, the step needs 3"):
        buf.fill([[1, 2, 3], [4, 5]], starts=[0, 0], tables=[[1], [2]], bucket=2)
    with pytest.raises(ValueError, match="sequence 0 has 5 blocks, buffers hold 4"):
        buf.fill([[1, 2, 3]], starts=[0], tables=[[1, 2, 3, 4, 5]], bucket=1)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_advance_kernel_matches_the_torch_reference(k: int) -> None:
    """The one-launch input advance of an overlapped speculative step writes the same tokens, positions,
    KV slots and lengths as the torch reference, for sequences pointing at arbitrary rows of the previous
    results (accepted counts 0..K, block-crossing positions)."""
    from mtpserve.workers import step_kernels

    q, m, bs = k + 1, 5, 4
    g = torch.Generator().manual_seed(k)
    previous = torch.randint(0, 1000, (7, 2 * q + 1), generator=g)
    previous[:, q] = torch.randint(0, k + 1, (7,), generator=g)  # accepted
    previous[:, 2 * q] = torch.randint(0, 20, (7,), generator=g)  # next start
    rows = [6, 0, 3, 3, 5]
    tables = [torch.randperm(40, generator=g)[:8].tolist() for _ in range(m)]
    bufs = [
        StepBuffers.allocate(8, q, 8, block_size=bs, scratch_block=99, device=torch.device("cpu")) for _ in range(2)
    ]
    for buf in bufs:
        buf.fill([[r] + [0] * k for r in rows], starts=[0] * m, tables=tables, bucket=8)
    step_kernels.advance_reference(previous, bufs[0], m, torch.arange(q))
    step_kernels.advance_inputs(previous, bufs[1], m)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(bufs[0], name), getattr(bufs[1], name)), name
    first = previous[rows[0]]
    assert bufs[1].input_ids[0].item() == first[first[q]].item() and bufs[1].seq_lens[0].item() == first[2 * q] + q


def _reference_fill(
    buf: StepBuffers, token_ids: list[list[int]], starts: list[int], tables: list[list[int]], bucket: int
) -> dict[str, Any]:
    """What `fill` must leave in the first `bucket` sequences' fields, written out row by row; of the block tables,
    each row's entries up to what its length reads (past them, entries are never read)."""
    q, bs, scratch = buf.q_len, buf.block_size, buf.scratch_block
    ids, pos, slots, lens, table = [], [], [], [], []
    for b in range(bucket):
        real = b < len(token_ids)
        row_table = tables[b] if real else [scratch] * -(-q // bs)
        table.append(row_table)
        lens.append(starts[b] + q if real else q)
        for j in range(q):
            p = starts[b] + j if real else j
            ids.append(token_ids[b][j] if real else 0)
            pos.append(p)
            slots.append(row_table[p // bs] * bs + p % bs if real else scratch * bs + j % bs)
    return {"ids": ids, "pos": pos, "slots": slots, "lens": lens, "tables": table}


@pytest.mark.parametrize("q", [1, 4])
def test_fill_matches_a_row_by_row_reference_after_any_earlier_step(q: int) -> None:
    """Random steps of 0-8 sequences, each filled after another step of a different size: the one-row
    decode path and the vectorised path both write exactly the reference rows, and nothing of the earlier
    steps leaks into padding or into what a sequence's length reads."""
    rng = random.Random(q)
    buf = StepBuffers.allocate(8, q, 6, block_size=4, scratch_block=50, device=torch.device("cpu"))
    sizes = [1, 2, 4, 8]
    for _ in range(60):
        n = rng.choice([0, 1, 1, 1, 2, 3, 5, 8])
        bucket = next(s for s in sizes if s >= max(n, 1)) if rng.random() < 0.8 else 8
        tables = [rng.sample(range(40), rng.randint(1, 6)) for _ in range(n)]
        starts = [rng.randint(0, len(t) * 4 - q) for t in tables]
        token_ids = [[rng.randint(1, 999) for _ in range(q)] for _ in range(n)]
        buf.fill(token_ids, starts, tables, bucket)
        want = _reference_fill(buf, token_ids, starts, tables, bucket)
        rows = bucket * q
        assert buf.input_ids[:rows].tolist() == want["ids"]
        assert buf.positions[:rows].tolist() == want["pos"]
        assert buf.slot_mapping[:rows].tolist() == want["slots"]
        assert buf.seq_lens[:bucket].tolist() == want["lens"]
        assert [buf.block_tables[b, : len(t)].tolist() for b, t in enumerate(want["tables"])] == want["tables"]
