"""Plans and results on the step link as columns (worker.proto's PlanColumns, ResultColumns): one repeated field
per dataclass field, so that encoding and decoding a step costs a few calls whatever its batch, where a message
per row costs a call per row and field. Rows with per-row extras (a seed, draft probabilities or parents, logit
processing, logprobs) travel as row messages instead (convert.py)."""

from __future__ import annotations

from itertools import accumulate, chain

from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.speculative.messages import SeqPlan, SeqResult
from mtpserve.workers.message_checks import InvalidStepMessage

CONTEXT, FINAL = 1, 2  # PlanColumns.flags bits


def plain_rows(seqs: list[SeqPlan]) -> bool:
    """Whether every row fits the columns: no seed, draft probabilities or parents, nor logit processing."""
    return all(
        s.seed is None and s.draft_probs is None and s.draft_parents is None and s.processing is None for s in seqs
    )


def plan_columns(seqs: list[SeqPlan]) -> wpb.PlanColumns:
    """Plain rows (`plain_rows`) -> columns."""
    return wpb.PlanColumns(
        request_ids=[s.request_id for s in seqs],
        starts=[s.start for s in seqs],
        token_counts=[len(s.token_ids) for s in seqs],
        token_ids=list(chain.from_iterable(s.token_ids for s in seqs)),
        block_counts=[len(s.block_ids) for s in seqs],
        block_ids=list(chain.from_iterable(s.block_ids for s in seqs)),
        flags=[CONTEXT * s.is_context + FINAL * s.is_final_chunk for s in seqs],
        lookahead_tokens=[s.lookahead_token for s in seqs],
        num_draft_tokens=[s.num_draft_tokens for s in seqs],
        temperatures=[s.temperature for s in seqs],
        top_ps=[s.top_p for s in seqs],
        top_ks=[s.top_k for s in seqs],
    )


def _spans(field: str, counts: list[int], total: int) -> list[int]:
    """Offsets of each row's slice of a concatenated column of `total` entries (InvalidStepMessage when the
    counts are negative or do not add up to it)."""
    if counts and min(counts) < 0:
        raise InvalidStepMessage(f"columns.{field}", "counts must not be negative")
    ends = list(accumulate(counts))
    if (ends[-1] if ends else 0) != total:
        raise InvalidStepMessage(f"columns.{field}", f"add up to {ends[-1] if ends else 0}, for {total} entries")
    return [0, *ends]


def seqs_from_columns(c: wpb.PlanColumns) -> list[SeqPlan]:
    """Columns -> rows; InvalidStepMessage when the columns disagree on the number of rows or their counts on
    the concatenated columns."""
    ids = list(c.request_ids)
    n = len(ids)
    fields = ("starts", "token_counts", "block_counts", "flags", "lookahead_tokens", "num_draft_tokens")
    for name in (*fields, "temperatures", "top_ps", "top_ks"):
        if len(getattr(c, name)) != n:
            raise InvalidStepMessage(f"columns.{name}", f"has {len(getattr(c, name))} entries for {n} request_ids")
    tokens, blocks = list(c.token_ids), list(c.block_ids)
    t = _spans("token_counts", list(c.token_counts), len(tokens))
    b = _spans("block_counts", list(c.block_counts), len(blocks))
    rows = zip(
        ids, c.starts, c.flags, c.lookahead_tokens, c.num_draft_tokens, c.temperatures, c.top_ps, c.top_ks, strict=True
    )
    return [
        SeqPlan(
            request_id=rid,
            token_ids=tokens[t[i] : t[i + 1]],
            start=start,
            block_ids=blocks[b[i] : b[i + 1]],
            is_context=bool(flags & CONTEXT),
            is_final_chunk=bool(flags & FINAL),
            lookahead_token=lookahead,
            num_draft_tokens=drafts,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
        for i, (rid, start, flags, lookahead, drafts, temperature, top_p, top_k) in enumerate(rows)
    ]


def plain_results(results: list[SeqResult]) -> bool:
    """Whether every result fits the columns: none carries logprobs."""
    return all(r.logprobs is None for r in results)


def result_columns(results: list[SeqResult]) -> wpb.ResultColumns:
    """Plain results (`plain_results`) -> columns."""
    return wpb.ResultColumns(
        request_ids=[r.request_id for r in results],
        token_counts=[len(r.new_token_ids) for r in results],
        new_token_ids=list(chain.from_iterable(r.new_token_ids for r in results)),
        num_drafted=[r.num_drafted for r in results],
        num_accepted=[r.num_accepted for r in results],
    )


def results_from_columns(c: wpb.ResultColumns) -> list[SeqResult]:
    """Columns -> results."""
    tokens = list(c.new_token_ids)
    t = _spans("token_counts", list(c.token_counts), len(tokens))
    rows = zip(c.request_ids, c.num_drafted, c.num_accepted, strict=True)
    return [
        SeqResult(rid, tokens[t[i] : t[i + 1]], drafted, accepted) for i, (rid, drafted, accepted) in enumerate(rows)
    ]
