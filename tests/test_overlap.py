"""Overlapped target-only decoding: the next step is queued before this step's tokens are read, its input
tokens gathered from the previous step's output on the device. Run eagerly on CPU over the fixed buffers
that CUDA captures."""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine import LLMEngine
from workers.runner import TargetRunner

from tiny import mimic_target, random_prompts, tiny_engine, with_uniform

PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 24},
    {"max_tokens": 9, "temperature": 0.8, "seed": 3},
    {"max_tokens": 30, "temperature": 1.0, "top_k": 20, "seed": 5},
    {"max_tokens": 16},
]


def drive(eng: LLMEngine, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
    """Three requests from the start, a fourth after 4 steps, the third aborted after 12; per request the
    tokens and finish reason, plus the KV blocks still held at the end."""
    ids = [eng.add_request(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(prompts[:3], params, strict=False))]
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            reasons[o.request_id] = o.finish_reason
        steps += 1
        if steps == 4:
            ids.append(eng.add_request(prompts[3], params[3], request_id="r3"))
        if steps == 12:
            eng.abort(ids[2])
    blocks = eng.scheduler.blocks
    return {"tokens": tokens, "reasons": reasons, "blocks_held": blocks.num_blocks - blocks.num_free}


def overlap_engine(overlap: bool) -> tuple[LLMEngine, list[int]]:
    """A target-only tiny engine with the fixed-buffer step; records which launches read device tokens."""
    args, w = mimic_target()
    eng = tiny_engine(args, w, model={"overlap_steps": overlap})
    with_uniform(eng, 0)
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    chained: list[int] = []
    launch = runner.launch

    def spy(plan, after=None):  # type: ignore[no-untyped-def]
        chained.append(int(after is not None))
        return launch(plan, after)

    runner.launch = spy  # type: ignore[method-assign]
    return eng, chained


def test_overlapped_decoding_emits_the_same_tokens() -> None:
    """Greedy and sampling requests, a stop token, a late arrival and an abort: the same tokens and finish
    reasons with and without overlap, most steps queued ahead, and every KV block returned."""
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [21, 5, 13, 9], seed=11)
    params = [dict(p) for p in PARAMS]
    probe, _ = overlap_engine(False)
    first = probe.generate(prompts[:1], params[0])[0].token_ids
    params[0]["stop_token_ids"] = [first[6]]  # request 0 stops on a token it emits part-way
    ref_engine, ref_chained = overlap_engine(False)
    want = drive(ref_engine, prompts, params)
    eng, chained = overlap_engine(True)
    got = drive(eng, prompts, params)
    assert got == want
    assert want["reasons"] == {"r0": "stop", "r1": "length", "r2": None, "r3": "length"}  # r2 was aborted
    assert 0 < len(want["tokens"]["r2"]) < 30
    assert len(want["tokens"]["r0"]) <= 7 and want["tokens"]["r0"][-1] == first[6]
    assert want["blocks_held"] == 0 and got["blocks_held"] == 0
    assert ref_chained == [], "without overlap nothing is launched ahead"
    assert sum(chained) >= 15 and sum(chained) > len(chained) // 2, (
        f"most decode steps must be queued ahead of their predecessor: {chained}"
    )


def test_plan_ahead_keeps_rows_and_leaves_out_requests_that_end_by_length() -> None:
    """The step after a pending decode step points each request at its row, one position further, and
    leaves out a request whose pending token is its last."""
    args, w = mimic_target()
    eng = tiny_engine(args, w)
    prompts = random_prompts(2, args.vocab_size, [6, 4], seed=2)
    eng.add_request(prompts[0], {"max_tokens": 2}, request_id="short")
    eng.add_request(prompts[1], {"max_tokens": 20}, request_id="long")
    eng.step()  # prefill: both have one token
    pending = eng.scheduler.schedule()
    assert [len(s.token_ids) for s in pending.seqs] == [1, 1]
    ahead = eng.scheduler.plan_ahead(pending)
    assert ahead is not None
    assert [s.request_id for s in ahead.seqs] == ["long"], "'short' ends with its pending token"
    row = [s.request_id for s in pending.seqs].index("long")
    assert ahead.seqs[0].token_ids == [row] and ahead.seqs[0].start == pending.seqs[row].start + 1
    eng.add_request(prompts[0], {"max_tokens": 5}, request_id="late")
    assert eng.scheduler.plan_ahead(pending) is None, "a waiting request goes through schedule()"


def test_device_token_gather_reads_the_previous_step() -> None:
    """With tokens_from, each row's input is the previous step's token at the row given in token_ids."""
    args, w = mimic_target()
    eng = tiny_engine(args, w)
    uniform = with_uniform(eng, 0)
    prompts = random_prompts(2, args.vocab_size, [7, 3], seed=4)
    for p in prompts:
        eng.add_request(p, {"max_tokens": 10})
    eng.step()
    plan = eng.scheduler.schedule()
    previous = torch.tensor([5, 3, 9])
    for sp, row in zip(plan.seqs, [2, 0], strict=True):
        sp.token_ids = [row]
    uniform.run(plan, 2, None, previous)
    assert uniform.buffers.input_ids[:2].tolist() == [9, 5]
