"""Arrivals while steps are launched ahead: they join the batch together, when they are an eighth of it or the
oldest has waited `scheduler.admit_wait_ms`, and the tokens are those of joining at once."""

from __future__ import annotations

from typing import Any

import pytest

from mtpserve.cluster.engine.admit_window import AdmitWindow
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.request import Request
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.tiny import mimic_target, random_prompts, tiny_engine, with_steps

BATCH = 12


def aged(ms: float, now: float = 100.0) -> Request:
    """A waiting request that arrived `ms` before `now`."""
    return Request("r", [1, 2], SamplingParams(), arrival_time=now - ms / 1000)


def test_the_rule() -> None:
    now, window = 100.0, AdmitWindow(wait_ms=6)
    assert not window.admit_now([aged(2)] * 5, 256, free_slots=10, now=now), "few and fresh: they wait"
    assert window.admit_now([aged(2)] * 32, 256, free_slots=40, now=now), "an eighth of the batch joins"
    assert window.admit_now([aged(6), aged(1)], 256, free_slots=10, now=now), "the oldest waited long enough"
    assert window.admit_now([aged(0)], 4, free_slots=1, now=now), "one is an eighth of a small batch"
    assert not window.admit_now([aged(60)] * 40, 256, free_slots=0, now=now), "no slot: no reason to stop"
    assert not window.admit_now([], 0, free_slots=8, now=now)
    assert AdmitWindow(wait_ms=0).admit_now([aged(0)], 256, free_slots=1, now=now), "wait 0 joins each at once"
    window.joined_at = now - 0.003  # the last prompt chunks were applied 3 ms ago
    assert not window.admit_now([aged(6)], 256, free_slots=10, now=now), "counted from the last join's end"
    assert window.admit_now([aged(6)], 256, free_slots=10, now=now + 0.003)


def launching_engine(admit_wait_ms: float, **scheduler: Any) -> tuple[LLMEngine, list[int]]:
    """A tiny target-only engine on the fixed-buffer step (buckets up to 16) with steps launched ahead; the
    list fills with the size of every step that ran in turn."""
    args, w = mimic_target()
    scheduler = {"admit_wait_ms": admit_wait_ms, "max_num_requests": 16, **scheduler}
    eng = tiny_engine(args, w, model={"steps_ahead": 1}, scheduler=scheduler)
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    step = UniformTargetStep(runner.model, runner.cache, 1, max_batch=16, max_blocks=8, device="cpu", use_graphs=False)
    runner = with_steps(eng, target=step)
    in_turn: list[int] = []
    execute = runner.execute
    runner.execute = lambda plan: in_turn.append(len(plan.seqs)) or execute(plan)  # type: ignore[method-assign]
    return eng, in_turn


def drive(eng: LLMEngine, late: dict[int, str]) -> tuple[dict[str, list[int]], list[int], list[int]]:
    """BATCH requests from the start and one more after each step numbered in `late` (from 1); every request's
    tokens, and after each step (item i after step i + 1) the number waiting and the steps launched so far."""
    prompts = random_prompts(BATCH + len(late), eng.args.vocab_size, [7, 12, 5], seed=4)
    params: dict[str, Any] = {"max_tokens": 40, "ignore_eos": True}
    for i in range(BATCH):
        eng.add_request(prompts[i], params, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    waiting: list[int] = []
    launched: list[int] = []
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps in late:
            eng.add_request(prompts[BATCH + len(waiting) % len(late)], params, request_id=late[steps])
        waiting.append(eng.scheduler.num_waiting)
        launched.append(eng.steps_launched)
    return tokens, waiting, launched


@pytest.mark.parametrize("wait_ms", [0.0, 1e6])
def test_arrivals_join_together_with_the_tokens_of_joining_at_once(wait_ms: float) -> None:
    """12 decoding, arrivals after steps 5 and 9: with no wait the first joins at the next read; with a long
    wait it rides the launched steps until the second makes them an eighth of the batch (2 x 8 >= 12), and both
    join in one step run in turn. Greedy tokens are the same either way and as without launching."""
    late = {5: "late-a", 9: "late-b"}
    eng, in_turn = launching_engine(wait_ms)
    tokens, waiting, _ = drive(eng, late)
    ref_eng = tiny_engine(*mimic_target(), model={"overlap_steps": False}, scheduler={"max_num_requests": 16})
    want, _, _ = drive(ref_eng, late)
    assert tokens == want and len(want["late-b"]) == 40
    assert eng.steps_launched > eng.steps_run // 2, "most steps are launched ahead"
    if wait_ms:
        assert waiting[4:8] == [1, 1, 1, 1], "the first arrival waits for the second"
        assert waiting[8] == 2 and sum(waiting[10:]) == 0, "then both join after the launched step is read"
        assert in_turn.count(BATCH + 2) == 1, "both joined in one step"
    else:
        assert waiting[4] == 1 and waiting[6] == 0, "the first arrival joins once the launched step is read"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_an_arrival_right_after_a_joining_step_rides_the_launched_steps() -> None:
    """Two arrivals join in a step run in turn (step 11, as above); a third that comes right after it does not
    join at the next step, which would run in turn again, but waits while the next steps are launched (the wait
    counts from the joining step's end, and one is not an eighth of 14). Tokens as without launching."""
    late = {5: "late-a", 9: "late-b", 11: "late-c"}
    eng, in_turn = launching_engine(1e6)
    tokens, waiting, launched = drive(eng, late)
    ref_eng = tiny_engine(*mimic_target(), model={"overlap_steps": False}, scheduler={"max_num_requests": 16})
    want, _, _ = drive(ref_eng, late)
    assert tokens == want and len(want["late-c"]) == 40
    assert waiting[9] == 2 and in_turn.count(BATCH + 2) == 1, "a and b joined at step 11"
    assert waiting[10:14] == [1, 1, 1, 1], "c (added after step 11) waits"
    assert launched[13] - launched[10] == 3, "steps 12-14 were launched"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_only_admitting_steps_restart_the_wait() -> None:
    """A 40-token prompt joins in 8-token chunks, one step each: the step that admitted it restarts the wait of
    later arrivals, the steps that only continue its prompt do not (they would hold arrivals for its prefill)."""
    eng, in_turn = launching_engine(1e6, chunk_size=8)
    short, long = random_prompts(2, eng.args.vocab_size, [5, 40], seed=3)
    eng.add_request(short, {"max_tokens": 30, "ignore_eos": True}, request_id="short")
    eng.step()
    admitted = eng.scheduler.window.joined_at
    eng.step()
    assert eng.scheduler.window.joined_at == admitted > 0, "a decode step restarts nothing"
    eng.add_request(long, {"max_tokens": 4, "ignore_eos": True}, request_id="long")
    stamps = []
    while eng.has_unfinished():
        eng.step()
        stamps.append(eng.scheduler.window.joined_at)
    assert in_turn.count(2) >= 5, "five prompt chunks ran beside the short request's decode rows"
    assert len(set(stamps) - {admitted}) == 1, "only the step that admitted 'long' restarted it"
    assert stamps[-1] > admitted


def test_the_default_wait_is_short() -> None:
    assert 0 < MTPServeConfig().scheduler.admit_wait_ms <= 10
