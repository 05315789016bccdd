"""Plans and results as columns on the step link: they come back equal to what was sent, rows with per-row extras
still travel as row messages, malformed columns are refused by field, and the one-pass row check of `check_plan`
accepts exactly the rows the per-row checks accept."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.speculative.logits_processing import LogitsProcessing
from mtpserve.speculative.messages import SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.token_logprobs import TokenLogprobs
from mtpserve.workers.convert import plan_from_proto, plan_to_proto, target_output_from_proto, target_output_to_proto
from mtpserve.workers.message_checks import InvalidStepMessage, StepLimits, check_plan, check_seq

LIM = StepLimits(
    num_blocks=64,
    block_size=4,
    max_model_len=40,
    vocab_size=50,
    max_num_requests=32,
    max_num_batched_tokens=512,
    num_draft_tokens=3,
    hidden_size=8,
    scratch_slots=2,
)


def random_rows(rng: random.Random, n: int) -> list[SeqPlan]:
    """Context rows, then generation rows, of random shapes that a worker built as LIM runs."""
    rows = []
    for i in range(n):
        context = i < n // 3
        drafts = 0 if context else rng.randrange(LIM.num_draft_tokens + 1)
        tokens = [rng.randrange(LIM.vocab_size) for _ in range(rng.randrange(1, 6) if context else drafts + 1)]
        start = rng.randrange(0, 20)
        final = not context or rng.random() < 0.5
        slots = start + len(tokens) + (LIM.scratch_slots if final else 0)
        blocks = rng.sample(range(LIM.num_blocks), -(-slots // LIM.block_size))
        rows.append(
            SeqPlan(
                f"r{i}",
                tokens,
                start,
                blocks,
                context,
                final,
                -1 if final else rng.randrange(LIM.vocab_size),
                drafts,
                temperature=rng.choice([0.0, 0.75]),
                top_p=rng.choice([1.0, 0.5]),  # float32 on the wire: values it holds exactly
                top_k=rng.choice([0, 5]),
            )
        )
    return rows


def over_the_wire(plan: StepPlan, columns: bool = True) -> StepPlan:
    return plan_from_proto(wpb.StepPlan.FromString(plan_to_proto(plan, columns).SerializeToString()))


def test_plans_come_back_equal_in_either_form() -> None:
    rng = random.Random(5)
    for n in (0, 1, 7, 32):
        plan = StepPlan(3, random_rows(rng, n), 3, ["gone"])
        check_plan(plan, LIM)
        assert plan_to_proto(plan).HasField("columns") and not plan_to_proto(plan, columns=False).HasField("columns")
        assert over_the_wire(plan) == plan == over_the_wire(plan, columns=False)


def test_rows_with_extras_travel_as_row_messages() -> None:
    rows = random_rows(random.Random(6), 6)
    extras = [
        {"seed": 11},
        {"draft_parents": [0, 0]},
        {"processing": LogitsProcessing(presence_penalty=0.5)},
    ]
    for extra in extras:
        plan = StepPlan(1, [*rows[:-1], dataclasses.replace(rows[-1], **extra)], 3)
        sent = plan_to_proto(plan)
        assert not sent.HasField("columns") and len(sent.seqs) == len(rows)
        back = over_the_wire(plan)
        assert [getattr(s, k) for s in back.seqs for k in extra] == [getattr(s, k) for s in plan.seqs for k in extra]
    probs = dataclasses.replace(rows[-1], token_ids=[1, 2], num_draft_tokens=1, draft_probs=torch.full((1, 50), 0.02))
    assert not plan_to_proto(StepPlan(1, [*rows[:-1], probs], 3)).HasField("columns")


def test_results_come_back_equal_in_either_form() -> None:
    plain = [SeqResult("a", [1, 2, 3], 2, 2), SeqResult("b", [], 0, 0), SeqResult("c", [9], 3, 0)]
    out = TargetOutput(4, plain, None, None, timing={})
    sent = target_output_to_proto(out)
    assert sent.HasField("columns") and not sent.results
    assert target_output_from_proto(wpb.TargetOutput.FromString(sent.SerializeToString())).results == plain
    lp = TokenLogprobs([-0.5], [[9, 4]], [[-0.5, -1.5]])
    with_logprobs = [*plain[:2], dataclasses.replace(plain[2], logprobs=lp)]
    sent = target_output_to_proto(TargetOutput(4, with_logprobs, None, None, timing={}))
    assert not sent.HasField("columns") and len(sent.results) == 3
    assert target_output_from_proto(sent).results == with_logprobs


@pytest.mark.parametrize(
    ("spoil", "field"),
    [
        (lambda c: c.starts.append(0), "columns.starts"),
        (lambda c: c.top_ks.pop(), "columns.top_ks"),
        (lambda c: c.token_ids.append(1), "columns.token_counts"),
        (lambda c: c.block_counts.__setitem__(0, c.block_counts[0] + 1), "columns.block_counts"),
        (lambda c: (c.token_counts.__setitem__(0, -1), c.token_counts.__setitem__(1, c.token_counts[1] + 1)), None),
    ],
)
def test_malformed_columns_are_refused_by_field(spoil, field: str | None) -> None:
    msg = plan_to_proto(StepPlan(2, random_rows(random.Random(7), 5), 3))
    spoil(msg.columns)
    with pytest.raises(InvalidStepMessage) as err:
        plan_from_proto(msg)
    assert err.value.field == (field or "columns.token_counts")


def test_a_plan_with_rows_in_both_forms_is_refused() -> None:
    plan = StepPlan(2, random_rows(random.Random(8), 3), 3)
    msg = plan_to_proto(plan)
    msg.seqs.extend(plan_to_proto(plan, columns=False).seqs)
    with pytest.raises(InvalidStepMessage, match="seqs or as columns"):
        plan_from_proto(msg)


def spoiled(rng: random.Random, s: SeqPlan) -> SeqPlan:
    """`s` with one field pushed to, or just past, a limit of LIM."""
    choices = {
        "token_ids": [[], [LIM.vocab_size], [-1], [LIM.vocab_size - 1] * len(s.token_ids)],
        "start": [-1, LIM.max_model_len - 1, LIM.max_model_len, LIM.max_model_len + LIM.num_draft_tokens],
        "block_ids": [[], s.block_ids[:-1], [*s.block_ids, LIM.num_blocks], [*s.block_ids, *s.block_ids[:1]]],
        "is_context": [not s.is_context],
        "is_final_chunk": [not s.is_final_chunk],
        "lookahead_token": [-1, 0, LIM.vocab_size, -2],
        "num_draft_tokens": [s.num_draft_tokens + 1, s.num_draft_tokens - 1],
        "temperature": [-0.1, float("nan"), float("inf"), 0.0],
        "top_p": [0.0, 1.0, 1.5, float("nan")],
        "top_k": [-1, 0],
    }
    name = rng.choice(sorted(choices))
    return dataclasses.replace(s, **{name: rng.choice(choices[name])})


def rows_pass_one_by_one(plan: StepPlan) -> bool:
    """The row checks of `check_plan`, applied row by row as its error path does."""
    generation = False
    for i, s in enumerate(plan.seqs):
        if s.is_context and generation:
            return False
        generation |= not s.is_context
        try:
            check_seq(f"seqs[{i}]", s, plan.num_draft_tokens, LIM)
        except InvalidStepMessage:
            return False
    return True


def test_check_plan_accepts_exactly_the_rows_the_row_checks_accept() -> None:
    rng = random.Random(9)
    verdicts = {True: 0, False: 0}
    for trial in range(600):
        rows = random_rows(rng, rng.randrange(1, 8))
        for _ in range(rng.randrange(3)):
            i = rng.randrange(len(rows))
            rows[i] = spoiled(rng, rows[i])
        plan = StepPlan(trial, rows, LIM.num_draft_tokens)
        ok = rows_pass_one_by_one(plan)
        verdicts[ok] += 1
        if ok:
            check_plan(plan, LIM)
        else:
            with pytest.raises(InvalidStepMessage):
                check_plan(plan, LIM)
    assert min(verdicts.values()) > 100, verdicts  # both kinds of plan were tried
