"""Checks of the step messages a worker receives over gRPC, against what the worker was built for.

A plan that names a KV block the cache does not have, a token outside the vocabulary or a position past
the model's length would index out of range on the device (or silently overwrite another request's KV);
the workers refuse such messages with INVALID_ARGUMENT naming the field, and keep serving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtpserve.speculative.messages import DraftInputs, SeqPlan, StepPlan

MAX_REQUEST_ID_CHARS = 1024
LOOKAHEAD_SOURCES = ("prompt", "sampled")


class InvalidStepMessage(ValueError):
    """A step message field the worker cannot run; `field` names it, as in `seqs[2].block_ids[0]`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class StepLimits:
    """What a worker can run: its KV cache, model length, vocabulary, slots, token budget and K."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    max_num_requests: int
    max_num_batched_tokens: int
    num_draft_tokens: int  # K the worker was built with (a tree's node budget; 0: no draft)
    hidden_size: int
    scratch_slots: int = 0  # KV slots past a proposing request's rows that drafting writes


def _ids_in_range(field: str, ids: Sequence[int], low: int, high: int) -> None:
    if not ids or (low <= min(ids) and max(ids) < high):
        return
    for j, t in enumerate(ids):
        if not low <= t < high:
            raise InvalidStepMessage(f"{field}[{j}]", f"{t} is out of range [{low}, {high})")


def _request_ids(field: str, ids: Sequence[str]) -> None:
    seen: set[str] = set()
    for i, rid in enumerate(ids):
        if not rid or len(rid) > MAX_REQUEST_ID_CHARS:
            raise InvalidStepMessage(f"{field}[{i}]", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters")
        if rid in seen:
            raise InvalidStepMessage(f"{field}[{i}]", f"repeats request id {rid[:64]!r}")
        seen.add(rid)


def _sampling(field: str, temperature: float, top_p: float, top_k: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidStepMessage(f"{field}.temperature", f"{temperature} is not a finite number >= 0")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidStepMessage(f"{field}.top_p", f"{top_p} is not in (0, 1]")
    if top_k < 0:
        raise InvalidStepMessage(f"{field}.top_k", f"{top_k} is negative")


def _blocks(field: str, block_ids: Sequence[int], slots: int, lim: StepLimits) -> None:
    _ids_in_range(field, block_ids, 0, lim.num_blocks)
    if len(set(block_ids)) != len(block_ids):
        raise InvalidStepMessage(field, "names a block twice")
    if len(block_ids) * lim.block_size < slots:
        raise InvalidStepMessage(field, f"{len(block_ids)} blocks of {lim.block_size} hold fewer than {slots} slots")


def check_seq(field: str, s: SeqPlan, k: int, lim: StepLimits) -> None:
    """One sequence of a plan whose proposals draft `k` tokens."""
    if not s.token_ids:
        raise InvalidStepMessage(f"{field}.token_ids", "is empty")
    _ids_in_range(f"{field}.token_ids", s.token_ids, 0, lim.vocab_size)
    last = s.end if s.draft_parents is None else s.start + 1 + _tree_depth(s.draft_parents)  # past the last position
    # a generation row's own token lies inside the model's length; its drafts may pass it (their tokens are cut)
    limit = lim.max_model_len if s.is_context else lim.max_model_len + lim.num_draft_tokens
    if s.start < 0 or last > limit or s.start >= lim.max_model_len:
        raise InvalidStepMessage(f"{field}.start", f"rows [{s.start}, {last}) leave [0, {limit})")
    if not s.is_context and not s.is_final_chunk:
        raise InvalidStepMessage(f"{field}.is_final_chunk", "a generation row is always final")
    drafts = 0 if s.is_context else len(s.token_ids) - 1
    if s.num_draft_tokens != drafts or drafts > lim.num_draft_tokens:
        why = f"is {s.num_draft_tokens}; this row carries {drafts} drafts (at most {lim.num_draft_tokens})"
        raise InvalidStepMessage(f"{field}.num_draft_tokens", why)
    if s.is_final_chunk and s.lookahead_token != -1:
        raise InvalidStepMessage(f"{field}.lookahead_token", "must be -1 on a final chunk")
    if not s.is_final_chunk:
        _ids_in_range(f"{field}.lookahead_token", [s.lookahead_token], 0, lim.vocab_size)
    _blocks(f"{field}.block_ids", s.block_ids, s.end + (lim.scratch_slots if s.is_final_chunk else 0), lim)
    if s.draft_parents is not None:
        _parents(f"{field}.draft_parents", s.draft_parents, s.token_ids, drafts)
        if s.draft_probs is not None:
            raise InvalidStepMessage(f"{field}.draft_probs", "draft trees carry one-hot drafts; send no draft_probs")
    _sampling(field, s.temperature, s.top_p, s.top_k)
    if s.draft_probs is not None:
        p = s.draft_probs
        if tuple(p.shape) != (drafts, lim.vocab_size) or not p.is_floating_point():
            raise InvalidStepMessage(
                f"{field}.draft_probs", f"must be float [{drafts}, {lim.vocab_size}], got {p.dtype} {list(p.shape)}"
            )
        lo, hi = torch.aminmax(p) if p.numel() else (torch.zeros(()), torch.zeros(()))
        if not (float(lo) >= 0 and float(hi) <= 1):  # one pass; NaN fails both comparisons
            raise InvalidStepMessage(f"{field}.draft_probs", "must be probabilities in [0, 1]")


def _parents(field: str, parents: Sequence[int], token_ids: Sequence[int], drafts: int) -> None:
    if len(parents) != drafts:
        raise InvalidStepMessage(field, f"has {len(parents)} entries for {drafts} drafts")
    siblings: set[tuple[int, int]] = set()
    for j, p in enumerate(parents):
        if not 0 <= p <= j:
            why = f"{p} is not in [0, {j}]: a draft continues the root or an earlier draft"
            raise InvalidStepMessage(f"{field}[{j}]", why)
        if (p, token_ids[j + 1]) in siblings:
            raise InvalidStepMessage(
                f"{field}[{j}]", f"repeats token {token_ids[j + 1]} among the children of node {p}"
            )
        siblings.add((p, token_ids[j + 1]))


def _tree_depth(parents: Sequence[int]) -> int:
    """Depth of a tree given its drafts' parents (entries already range-checked or not: clamped here)."""
    depth = [0]
    for j, p in enumerate(parents):
        depth.append(depth[min(max(p, 0), j)] + 1)
    return max(depth)


def check_plan(plan: StepPlan, lim: StepLimits) -> None:
    """Raise InvalidStepMessage for the first field of `plan` the worker cannot run."""
    if not 0 <= plan.num_draft_tokens <= lim.num_draft_tokens:
        raise InvalidStepMessage("num_draft_tokens", f"{plan.num_draft_tokens} is not in [0, {lim.num_draft_tokens}]")
    if len(plan.seqs) > lim.max_num_requests:
        raise InvalidStepMessage("seqs", f"{len(plan.seqs)} sequences exceed max_num_requests {lim.max_num_requests}")
    if plan.num_tokens > lim.max_num_batched_tokens:
        raise InvalidStepMessage(
            "seqs", f"{plan.num_tokens} rows exceed max_num_batched_tokens {lim.max_num_batched_tokens}"
        )
    _request_ids("seqs.request_id", [s.request_id for s in plan.seqs])
    if _rows_pass(plan.seqs, lim):
        return
    seen_generation = False
    for i, s in enumerate(plan.seqs):
        if s.is_context and seen_generation:
            raise InvalidStepMessage(f"seqs[{i}].is_context", "context sequences must come before generation ones")
        seen_generation |= not s.is_context
        check_seq(f"seqs[{i}]", s, plan.num_draft_tokens, lim)


def _rows_pass(seqs: Sequence[SeqPlan], lim: StepLimits) -> bool:
    """Whether chain and context rows (no draft parents or probabilities) pass every check of `check_seq` and the
    row order of `check_plan`, with no per-row field names built: the common case in one pass. False sends the
    plan through the row checks, which name the first field that fails (or pass a tree's rows)."""
    vocab, model_len, k, size = lim.vocab_size, lim.max_model_len, lim.num_draft_tokens, lim.block_size
    generation = False
    for s in seqs:
        ids, blocks, context, final = s.token_ids, s.block_ids, s.is_context, s.is_final_chunk
        if s.draft_parents is not None or s.draft_probs is not None or not ids or (context and generation):
            return False
        generation |= not context
        end = s.start + len(ids)
        drafts = 0 if context else len(ids) - 1
        if not (
            min(ids) >= 0
            and max(ids) < vocab
            and 0 <= s.start < model_len
            and end <= (model_len if context else model_len + k)
            and (context or final)
            and s.num_draft_tokens == drafts <= k
            and (s.lookahead_token == -1 if final else 0 <= s.lookahead_token < vocab)
            and (not blocks or (min(blocks) >= 0 and max(blocks) < lim.num_blocks))
            and len(set(blocks)) == len(blocks)
            and len(blocks) * size >= end + (lim.scratch_slots if final else 0)
            and math.isfinite(s.temperature)
            and s.temperature >= 0
            and math.isfinite(s.top_p)
            and 0 < s.top_p <= 1
            and s.top_k >= 0
        ):
            return False
    return True


def _per_request(d: DraftInputs, b: int) -> None:
    for name in ("seq_lens", "is_context", "block_ids", "propose", "temperature", "top_p", "top_k", "seed"):
        n = len(getattr(d, name))
        if n != b:
            raise InvalidStepMessage(name, f"has {n} entries for {b} request_ids")


def _tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], integer: bool, sized_by: str) -> None:
    if tuple(t.shape) != shape or t.is_floating_point() == integer:
        kind = "integer" if integer else "float"
        raise InvalidStepMessage(name, f"must be {kind} {list(shape)} (from {sized_by}), got {t.dtype} {list(t.shape)}")


def check_draft_inputs(d: DraftInputs, lim: StepLimits) -> None:
    """Raise InvalidStepMessage for the first field of `d` the draft worker cannot run."""
    b = len(d.request_ids)
    if b > lim.max_num_requests:
        raise InvalidStepMessage("request_ids", f"{b} requests exceed max_num_requests {lim.max_num_requests}")
    _request_ids("request_ids", d.request_ids)
    _per_request(d, b)
    if not 0 <= d.num_draft_tokens <= lim.num_draft_tokens:
        raise InvalidStepMessage("num_draft_tokens", f"{d.num_draft_tokens} is not in [0, {lim.num_draft_tokens}]")
    if d.lookahead_source not in LOOKAHEAD_SOURCES:
        raise InvalidStepMessage("lookahead_source", f"{d.lookahead_source[:64]!r} is not one of {LOOKAHEAD_SOURCES}")
    if any(n < 1 for n in d.seq_lens) or sum(d.seq_lens) > lim.max_num_batched_tokens:
        raise InvalidStepMessage("seq_lens", f"each must be >= 1 and all at most {lim.max_num_batched_tokens} rows")
    t = sum(d.seq_lens)
    _tensor("token_ids", d.token_ids, (t,), integer=True, sized_by="seq_lens")
    _ids_in_range("token_ids", d.token_ids.tolist(), 0, lim.vocab_size)
    _tensor("positions", d.positions, (t,), integer=True, sized_by="seq_lens")
    positions = d.positions.tolist()
    # accepted drafts of a request's last step may lie past max_model_len (their tokens are cut)
    _ids_in_range("positions", positions, 0, lim.max_model_len + lim.num_draft_tokens + 1)
    _tensor("lookahead_tokens", d.lookahead_tokens, (sum(d.is_context),), integer=True, sized_by="is_context")
    _ids_in_range("lookahead_tokens", d.lookahead_tokens.tolist(), -1, lim.vocab_size)
    _tensor("sampled_tokens", d.sampled_tokens, (b,), integer=True, sized_by="request_ids")
    _ids_in_range("sampled_tokens", d.sampled_tokens.tolist(), 0, lim.vocab_size)
    h = d.hidden_states
    if h.dim() != 2 or h.shape[0] != t or h.shape[1] == 0 or h.shape[1] % lim.hidden_size or not h.is_floating_point():
        raise InvalidStepMessage(
            "hidden_states", f"must be float [{t}, n*{lim.hidden_size}] (from seq_lens), got {h.dtype} {list(h.shape)}"
        )
    row = 0
    for i, n in enumerate(d.seq_lens):
        last = positions[row + n - 1] + 1
        slots = last + (lim.scratch_slots if d.propose[i] else 0)
        _blocks(f"block_ids[{i}]", d.block_ids[i], slots, lim)
        _sampling(f"request {i}", d.temperature[i], d.top_p[i], d.top_k[i])
        row += n
