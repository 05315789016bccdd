"""Launched steps that carry arriving requests' prompts beside the generation rows.

When requests arrive while steps are launched ahead, the scheduler plans them into the next launched step
(`Scheduler.plan_ahead`), each whole prompt one final chunk, ahead of the generation rows. The chunks replay
through the captured prefill step and the generation rows through the captured generation step (their inputs
taken on the device from the step before), both queued without waiting. The step's results are laid out as the
generation step's, one row per sequence in the plan's order, so the step after it reads every request's inputs
from them, the joined requests' too: a chunk's row holds its first token as the one emitted token, no accepted
draft, its drafts (with a chain) and its end as the next start.

Example, a K=2 chain, plan [C (a prompt, positions 0-19), A (generation, row 0 of the step before), B (row 1)]:
the prefill replay gives C's first token t and drafts d1, d2; the chain step gives A's and B's rows; the results
are [[t, 0, 0 | 0 | d1, d2 | 20], A's row, B's row] ([emitted K+1 | accepted | drafts K | next start]).
Target-only rows are [accepted | token], so C's is [0, t]."""

from __future__ import annotations

import torch

from mtpserve.speculative.messages import SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.workers.prefill_step import CapturedPrefill

Replay = tuple[list[int], int]  # a prefill replay: the chunks it takes (their indexes) and its row bucket


def joinable(prefill: CapturedPrefill | None, plan: StepPlan, chunks: int, chain: bool) -> list[Replay] | None:
    """The prefill replays that take the plan's leading `chunks` (`CapturedPrefill.groups`: each replay's chunk
    indexes and row bucket), when the rest are generation rows and every chunk ends its prompt without logit
    rules; with a `chain`, the prefill step must draft the plan's depth. None otherwise."""
    if prefill is None or any(s.is_context for s in plan.seqs[chunks:]):
        return None
    if chain and plan.num_draft_tokens > 0 and (prefill.chain is None or prefill.k < plan.num_draft_tokens):
        return None
    seqs = plan.seqs[:chunks]
    if any(not s.is_final_chunk or s.processing is not None for s in seqs):
        return None
    return prefill.groups(seqs)


def prompt_results(first: torch.Tensor, seqs: list[SeqPlan], depth: int, chain: bool) -> torch.Tensor:
    """The prefill replay's rows `first` ([chunks, 1 + drafts]: first token, drafts) laid out as the generation
    step's results: [first, 0 x depth | 0 | drafts[:depth] | end] with a chain, [0 | first] target-only."""
    n, dev = len(seqs), first.device
    if not chain:
        return torch.stack([torch.zeros(n, dtype=torch.long, device=dev), first[:, 0].long()], dim=1)
    rows = torch.zeros((n, 2 * depth + 3), dtype=torch.long, device=dev)
    rows[:, 0] = first[:, 0]
    rows[:, depth + 2 : 2 * depth + 2] = first[:, 1 : 1 + depth]
    ends = torch.tensor([s.end for s in seqs], dtype=torch.long, pin_memory=dev.type == "cuda")
    rows[:, -1] = ends.to(dev, non_blocking=True)
    return rows


def without_drafted(out: TargetOutput, chunks: int) -> TargetOutput:
    """A joined step's output read as a generation step's, its leading `chunks` results counting no drafts."""
    for i, r in enumerate(out.results[:chunks]):
        out.results[i] = SeqResult(r.request_id, r.new_token_ids, 0, 0)
    return out
