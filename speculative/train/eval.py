"""Teacher-forced K-chain acceptance of a draft head on held-apart sequences (greedy verification).

From every base position p of a response, the chain proposes d1..dK: step 1 reads (t[p+1], H[p]);
step k reads (d_{k-1}, h_{k-1}) and attends to draft KV of positions <= p computed from target hidden
states plus the chain's own earlier steps (see `dense.head_unrolled`). Draft d_k is accepted when
d_1..d_{k-1} were and d_k equals the target's argmax after them. On greedy-generated sequences the
target's argmax after an accepted prefix is the stored next token, so teacher forcing is exact there;
a chain is also cut wherever the stored token differs from the target argmax (sampled data).

acceptance length = 1 + mean accepted drafts per base; rate[k] = share of bases whose first k drafts
were all accepted (so acceptance length = 1 + sum(rate)).

Decoding does not start a chain at every position: after a chain at base p accepts a drafts, the next one
starts at p + a + 1. Long accepted runs are crossed in few steps and misses cost a step each, so the figure
users see is lower than the average over all bases. `online_chains` follows that path through the
teacher-forced counts; on greedy sequences it visits the bases the engine visits and counts what the
engine's speculation counters count (`online_acceptance_length`). `first_acceptance_length` does the same
over the first `FIRST_TOKENS` emitted tokens only, what `mtpserve bench acceptance --max-tokens 128` measures:
a small target's long greedy answers fall into repeated text, which is easy to draft, so the figure over
whole answers reads well above what the start of an answer gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.train.batches import Batch, HiddenStore, autocast_ctx
from mtpserve.speculative.train.dense import head_unrolled

FIRST_TOKENS = 128  # the window of `first_acceptance_length` (the held-apart benchmark's --max-tokens)


def _argmax_rows(
    pick: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, rows: torch.Tensor, fill: int
) -> torch.Tensor:
    """`pick(h[rows])` (token ids) at `rows` (bool [B, L]) of h [B, L, d]; `fill` elsewhere."""
    out = torch.full(rows.shape, fill, dtype=torch.long, device=h.device)
    if rows.any():
        out[rows] = pick(h[rows])
    return out


def target_argmax(shared: LlamaModel, batch: Batch) -> torch.Tensor:
    """The target's argmax at every response row q (token q+1) [B, L]; -1 elsewhere."""
    q = torch.arange(batch.ids.shape[1], device=batch.ids.device)[None, :]
    rows = (q >= batch.response_start[:, None] - 1) & (q < batch.lengths[:, None])
    return _argmax_rows(lambda h: shared.logits(h).argmax(-1), batch.hidden, rows, -1)


@torch.no_grad()
def accepted_runs(
    head: DraftHead, shared: LlamaModel, batch: Batch, k: int, tgt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`run` [B, L-K]: drafts accepted by the chain at each base, `base_ok` [B, L-K]: where a whole chain
    fits in the stored response). `tgt` (from `target_argmax`) may be shared by several heads."""
    ids = batch.ids
    bsz, length = ids.shape
    q = torch.arange(length, device=ids.device)[None, :]
    r = batch.response_start[:, None]
    n = batch.lengths[:, None]
    tgt = target_argmax(shared, batch) if tgt is None else tgt
    outs = head_unrolled(head, shared, ids, batch.features_for(head.feature_layers), steps=k)
    draft_rows = (q >= r - 1) & (q <= n - 2)
    next_tgt = torch.nn.functional.pad(tgt[:, 1:], (0, 1), value=-2)
    consistent = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-3) == tgt  # stored t[q+1] == argmax row q
    nb = max(length - k, 0)
    base = torch.arange(nb, device=ids.device)[None, :]
    base_ok = (base >= r - 1) & (base <= n - 1 - k)
    alive = base_ok.clone()
    run = torch.zeros(bsz, nb, dtype=torch.long, device=ids.device)
    for j in range(1, k + 1):
        d = _argmax_rows(lambda h: head.greedy_tokens(shared, h), outs[j - 1], draft_rows, -4)
        match = d == next_tgt  # draft at row q == target argmax at row q+1
        if j > 1:
            match &= consistent
        alive &= match[:, j - 1 : j - 1 + nb]
        run += alive
    return run, base_ok


@torch.no_grad()
def batch_acceptance(
    head: DraftHead,
    shared: LlamaModel,
    batch: Batch,
    k: int,
    tgt: torch.Tensor | None = None,
    first_tokens: int = FIRST_TOKENS,
) -> dict[str, torch.Tensor]:
    """Per-batch counts: `bases` [B] chains evaluated per sequence, `accepted` [B, K] chains reaching each depth,
    `online` [B, 2] (chains, accepted drafts) along the decoding path (`online_chains`), and `first` [B, 2]
    the same within the first `first_tokens` emitted tokens."""
    run, base_ok = accepted_runs(head, shared, batch, k, tgt=tgt)
    accepted = torch.stack([(run >= j).sum(1) for j in range(1, k + 1)], 1)
    runs = run.tolist()
    online, first = [], []
    for b in range(run.shape[0]):
        start, last = int(batch.response_start[b]) - 1, int(batch.lengths[b]) - 1 - k
        online.append(online_chains(runs[b], start, last))
        first.append(online_chains(runs[b], start, last, max_tokens=first_tokens))
    counts = {"online": torch.tensor(online, dtype=torch.long), "first": torch.tensor(first, dtype=torch.long)}
    return {"bases": base_ok.sum(1), "accepted": accepted, **counts}


def path_bases(run: list[int], first: int, last: int, max_tokens: int | None = None) -> list[int]:
    """The bases greedy decoding starts a chain at when the chain at base p accepts `run[p]` drafts: `first`
    (the prompt's last row), then p + run[p] + 1 each time, while the base is at most `last` and, with
    `max_tokens`, fewer tokens than that have been emitted (the prompt step emits one)."""
    bases: list[int] = []
    p, emitted = first, 1
    while p <= last and (max_tokens is None or emitted < max_tokens):
        bases.append(p)
        emitted += 1 + run[p]
        p += 1 + run[p]
    return bases


def online_chains(run: list[int], first: int, last: int, max_tokens: int | None = None) -> tuple[int, int]:
    """(chains, accepted drafts) along `path_bases`."""
    bases = path_bases(run, first, last, max_tokens)
    return len(bases), sum(run[p] for p in bases)


def summarize(
    bases: int,
    accepted: list[int],
    sequences: int,
    online: tuple[int, int] = (0, 0),
    first: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """The acceptance dict: acceptance_length, per-position rates, the decoding-path figures (whole answers
    and their first tokens) and the raw counts."""
    rates = [a / bases if bases else 0.0 for a in accepted]
    cond = [
        (accepted[i] / accepted[i - 1] if i and accepted[i - 1] else (rates[0] if i == 0 else 0.0))
        for i in range(len(accepted))
    ]
    return {
        "acceptance_length": 1.0 + sum(rates),
        "per_position": rates,
        "conditional_per_position": cond,
        "online_acceptance_length": 1.0 + (online[1] / online[0] if online[0] else 0.0),
        "online_chains": online[0],
        "first_acceptance_length": 1.0 + (first[1] / first[0] if first[0] else 0.0),
        "first_chains": first[0],
        "bases": bases,
        "sequences": sequences,
    }


@torch.no_grad()
def evaluate(
    head: DraftHead,
    shared: LlamaModel,
    store: HiddenStore,
    indices: list[int],
    k: int,
    *,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    first_tokens: int = FIRST_TOKENS,
) -> dict[str, Any]:
    """Acceptance over `indices` of the store's dataset, overall and per prompt source."""
    return evaluate_heads(
        {"head": head}, shared, store, indices, k=k, batch_size=batch_size, dtype=dtype, first_tokens=first_tokens
    )["head"]


@torch.no_grad()
def evaluate_heads(
    heads: dict[str, DraftHead],
    shared: LlamaModel,
    store: HiddenStore,
    indices: list[int],
    k: int,
    *,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    first_tokens: int = FIRST_TOKENS,
) -> dict[str, dict[str, Any]]:
    """`evaluate` for several heads on the same batches (the target forward runs once per batch)."""
    modes = {name: h.training for name, h in heads.items()}
    for h in heads.values():
        h.eval()
    totals: dict[str, dict[str, list[int]]] = {name: {} for name in heads}
    seqs: dict[str, int] = {}
    order = sorted(indices, key=lambda i: store.data.ids[i].numel())
    with autocast_ctx(store.device, dtype):
        for lo in range(0, len(order), batch_size):
            batch = store.batch(order[lo : lo + batch_size])
            tgt = target_argmax(shared, batch)
            for src in batch.sources:
                for key in ("all", src):
                    seqs[key] = seqs.get(key, 0) + 1
            for name, head in heads.items():
                res = batch_acceptance(head, shared, batch, k, tgt=tgt, first_tokens=first_tokens)
                for b, src in enumerate(batch.sources):
                    row = [int(res["bases"][b]), *res["accepted"][b].tolist(), *res["online"][b].tolist()]
                    row += res["first"][b].tolist()
                    for key in ("all", src):
                        t = totals[name].setdefault(key, [0] * (k + 5))
                        for i, v in enumerate(row):
                            t[i] += v
    for name, h in heads.items():
        h.train(modes[name])
    out: dict[str, dict[str, Any]] = {}

    def counts(v: list[int], n: int) -> dict[str, Any]:
        return summarize(v[0], v[1 : k + 1], n, online=(v[k + 1], v[k + 2]), first=(v[k + 3], v[k + 4]))

    for name, tot in totals.items():
        summary = counts(tot.get("all", [0] * (k + 5)), seqs.get("all", 0))
        summary["num_draft_tokens"] = k
        summary["first_tokens"] = first_tokens
        summary["by_source"] = {s: counts(v, seqs[s]) for s, v in sorted(tot.items()) if s != "all"}
        out[name] = summary
    return out
