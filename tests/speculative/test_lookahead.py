"""The prompt-lookahead contract (DESIGN.md points 1-4) on the buffer and on draft-input selection."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cluster.engine.request import Request
from mtpserve.cluster.engine.sampling_params import SamplingParams
from mtpserve.cluster.engine.scheduler import Scheduler
from mtpserve.speculative.draft_inputs import draft_input_tokens
from mtpserve.speculative.lookahead import INVALID_TOKEN, LookaheadBuffer, lookahead_for_chunk
from mtpserve.workers.config import SchedulerConfig


def select(tokens: list[list[int]], ctx: list[bool], lookahead: list[int], sampled: list[int], source: str = "prompt"):
    buf = LookaheadBuffer(8)
    buf.write(lookahead)
    index = torch.full((len(tokens),), -1)
    pos = [i for i, c in enumerate(ctx) if c]
    index[pos] = torch.arange(len(pos))
    out = draft_input_tokens(
        torch.tensor([t for s in tokens for t in s]),
        torch.tensor([len(s) for s in tokens]),
        index,
        buf.tokens,
        sampled_tokens=torch.tensor(sampled),
        lookahead_source=source,
    )
    return torch.split(out, [len(s) for s in tokens])


def test_non_final_chunk_uses_prompt_lookahead() -> None:
    (rows,) = select([[10, 11, 12]], [True], [13], [99])
    assert rows.tolist() == [11, 12, 13]


def test_final_chunk_falls_back_to_sampled_token() -> None:
    (rows,) = select([[10, 11, 12]], [True], [INVALID_TOKEN], [42])
    assert rows.tolist() == [11, 12, 42]


def test_token_zero_is_a_valid_lookahead() -> None:
    (rows,) = select([[5, 6]], [True], [0], [42])
    assert rows.tolist() == [6, 0]
    assert lookahead_for_chunk([5, 6, 0, 1], 2, False) == 0


def test_one_token_prompt() -> None:
    assert lookahead_for_chunk([7], 1, True) == INVALID_TOKEN
    (rows,) = select([[7]], [True], [INVALID_TOKEN], [3])
    assert rows.tolist() == [3]


def test_chunk_ending_at_second_to_last_token() -> None:
    prompt = [1, 2, 3, 4, 5]
    assert lookahead_for_chunk(prompt, 4, False) == 5
    (rows,) = select([[1, 2, 3, 4]], [True], [5], [77])
    assert rows.tolist() == [2, 3, 4, 5]
    (last,) = select([[5]], [True], [INVALID_TOKEN], [77])
    assert last.tolist() == [77]


def test_sampled_source_reproduces_the_bug() -> None:
    (rows,) = select([[10, 11, 12]], [True], [13], [99], source="sampled")
    assert rows.tolist() == [11, 12, 99]


def test_several_context_requests_and_generation_rows() -> None:
    rows = select(
        [[1, 2], [3], [4, 5, 6], [7, 8]],
        [True, False, True, True],
        [50, INVALID_TOKEN, 0],
        [60, 61, 62, 63],
    )
    assert [r.tolist() for r in rows] == [[2, 50], [61], [5, 6, 62], [8, 0]]


def test_buffer_clears_stale_entries_and_keeps_its_address() -> None:
    buf = LookaheadBuffer(6)
    ptr = buf.tokens.data_ptr()
    buf.write([4, 5, 6, 7])
    assert buf.tokens.tolist() == [4, 5, 6, 7, -1, -1]
    buf.write([9])
    assert buf.tokens.tolist() == [9, -1, -1, -1, -1, -1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(0, 7, (1,), generator=gen))
        vals = torch.randint(0, 1000, (n,), generator=gen)
        buf.write(vals)
        assert buf.tokens.data_ptr() == ptr
        assert buf.tokens[:n].tolist() == vals.tolist()
        assert (buf.tokens[n:] == INVALID_TOKEN).all()
    with pytest.raises(ValueError):
        buf.write(list(range(7)))


def test_scheduler_derives_lookahead_from_cursor_not_prompt_length() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=4, chunk_size=4, max_num_requests=2, block_size=4)
    sched = Scheduler(cfg, 32, 0, eos_token_ids=[], max_model_len=100)
    req = Request("a", [0, 1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    req.output_token_ids = [0, 8]  # a preempted request: context is prompt + output
    sched.add(req)
    plans = [sched.schedule() for _ in range(1)]
    s = plans[0].seqs[0]
    assert (s.start, s.end, s.is_final_chunk, s.lookahead_token) == (0, 4, False, 4)
    from mtpserve.speculative.messages import SeqResult, TargetOutput

    sched.update(plans[0], TargetOutput(1, [SeqResult("a", [])]), None)
    s2 = sched.schedule().seqs[0]
    assert (s2.start, s2.end, s2.is_final_chunk, s2.lookahead_token) == (4, 8, True, -1)
