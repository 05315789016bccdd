"""The rows of a step run in eager torch: logit rules applied to them, and what their verification found."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtpserve.speculative.logits_processing import process_rows, row_branches
from mtpserve.speculative.messages import StepPlan
from mtpserve.speculative.token_logprobs import TokenLogprobs


@dataclass
class Verified:
    """A step's verify results per sequence."""

    tokens: list[list[int]]
    accepted: list[int]
    last_token: list[int]
    starts: list[int]  # each sequence's first hidden row
    paths: dict[int, list[int]] = field(default_factory=dict)  # accepted nodes of each tree, by sequence
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)


def processed_logits(plan: StepPlan, logits: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """`logits` with each sequence's rules applied to its rows (spans[i] in `logits`); the same tensor when
    no sequence has a rule that changes logits."""
    ruled = [i for i, s in enumerate(plan.seqs) if s.processing is not None and s.processing.changes_logits]
    if not ruled:
        return logits
    out = logits.clone()
    for i in ruled:
        s, (a, b) = plan.seqs[i], spans[i]
        assert s.processing is not None
        branches = row_branches(s.token_ids, s.draft_parents, b - a) if not s.is_context else [[]]
        out[a:b] = process_rows(logits[a:b], s.processing, branches)
    return out
