"""The unrolled self-distillation loss: soft cross-entropy against the target's next-token distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.modeling.model import LlamaModel
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.train.batches import Batch
from mtpserve.speculative.train.dense import head_unrolled
from mtpserve.speculative.train.eval import path_bases

REPEAT_NGRAM = 8  # a response token is a repeat when the 8-gram ending at it occurred earlier in the response


def default_step_weights(k: int, decay: float = 0.7) -> list[float]:
    """Loss weight per unrolled step: 1, 0.7, 0.49, ..."""
    return [decay**i for i in range(k)]


@dataclass
class TargetRows:
    """The rows a batch's loss counts and the target's distribution there (N rows, V vocabulary)."""

    rb: torch.Tensor  # [N] sequence of each row
    rq: torch.Tensor  # [N] position of each row (its chain's step-1 row)
    prob: torch.Tensor  # [N, V] fp32 target distribution of token q + 2 (read at row q + 1)
    argmax: torch.Tensor  # [N] the target's greedy token there
    repeated: torch.Tensor | None = None  # [N] bool, token q + 2 is a repeat (`repeated_tokens`); None: not asked


@torch.no_grad()
def target_rows(shared: LlamaModel, batch: Batch, repeats: bool = False) -> TargetRows:
    """Rows q whose chain base p = q - k + 1 is a response base (p >= response_start - 1) for some step k,
    and whose predicted token q + 2 lies in the sequence; with the target's distribution there and, with
    `repeats`, whether that token is a repeat."""
    ids = batch.ids
    q = torch.arange(ids.shape[1], device=ids.device)[None, :]
    r = batch.response_start[:, None]
    valid = (q >= r - 1) & (q <= batch.lengths[:, None] - 3)
    rb, rq = valid.nonzero(as_tuple=True)
    if rb.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=ids.device)
        return TargetRows(
            rb, rq, torch.zeros(0, shared.args.vocab_size, device=ids.device), empty, repeated=empty.bool()
        )
    logits = shared.logits(batch.hidden[rb, rq + 1])
    repeated = repeated_tokens(ids, batch.lengths, batch.response_start)[rb, rq + 2] if repeats else None
    return TargetRows(rb, rq, torch.softmax(logits, dim=-1), logits.argmax(-1), repeated=repeated)


def draft_distribution(head: DraftHead, prob: torch.Tensor) -> torch.Tensor:
    """The target distribution restricted to the head's draft vocabulary and renormalised (as is when full)."""
    if head.vocab_ids is None:
        return prob
    sub = prob[:, head.vocab_ids]
    return sub / sub.sum(-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def decoding_path_mask(batch: Batch, hits: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[B, L] bool: the bases greedy decoding with this head visits (`path_bases`), from each unrolled step's
    (sequence, row, draft == target argmax) triples; step j's row q belongs to base q - j + 1."""
    bsz, length = batch.ids.shape
    dev = batch.ids.device
    run = torch.zeros(bsz, length, dtype=torch.long, device=dev)
    alive = torch.ones(bsz, length, dtype=torch.bool, device=dev)
    for j, (b, q, hit) in enumerate(hits, start=1):
        m = torch.zeros(bsz, length + j, dtype=torch.bool, device=dev)
        m[b, q] = hit
        alive &= m[:, j - 1 : j - 1 + length]
        run += alive
    runs = run.tolist()
    mask = torch.zeros(bsz, length, dtype=torch.bool)
    for i in range(bsz):
        bases = path_bases(runs[i], int(batch.response_start[i]) - 1, int(batch.lengths[i]) - 3)
        mask[i, bases] = True
    return mask.to(dev)


@torch.no_grad()
def repeated_tokens(
    ids: torch.Tensor, lengths: torch.Tensor, response_start: torch.Tensor, n: int = REPEAT_NGRAM
) -> torch.Tensor:
    """[B, L] bool for right-padded ids [B, L]: response tokens t where the n tokens ending at t (all in the
    response) already occurred together earlier in the same response (the loops of long greedy answers)."""
    bsz, length = ids.shape
    dev = ids.device
    key = torch.zeros_like(ids)
    for i in range(n):  # a polynomial hash of the n-gram ending at each position (int64 wraps around)
        key = key * 1_000_003 + torch.nn.functional.pad(ids, (i, 0), value=-1)[:, :length]
    pos = torch.arange(length, device=dev)[None, :].expand(bsz, length)
    valid = (pos >= response_start[:, None] + n - 1) & (pos < lengths[:, None])
    seq = torch.arange(bsz, device=dev)[:, None].expand(bsz, length)
    key = torch.where(valid, key * 4099 + seq, -1 - (seq * length + pos))  # invalid slots never match
    _, inv = torch.unique(key.flatten(), return_inverse=True)
    first = torch.full((int(inv.max()) + 1,), length, dtype=torch.long, device=dev)
    first.scatter_reduce_(0, inv, pos.flatten(), reduce="amin")
    return (pos.flatten() > first[inv]).view(bsz, length) & valid


def unrolled_loss(
    head: DraftHead,
    shared: LlamaModel,
    batch: Batch,
    weights: list[float],
    rows: TargetRows | None = None,
    path_weight: float = 0.0,
    repeat_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted mean over steps of soft CE(target p at row q+1, draft at row q), on response positions.

    Step k's row q belongs to the chain from base p = q - k + 1; rows count when p >= response_start - 1
    (the first base at inference is the prompt's last token) and the predicted token q + 2 lies in the
    sequence. `rows` (from `target_rows`, with `repeats` for a `repeat_weight` other than 1) may be shared by
    several heads trained on the same batch.
    With `path_weight` w > 0 a chain whose base greedy decoding with the head as it is now would visit
    counts 1 + w times (on sampled answers the path follows the target's argmax, not the stored tokens).
    A row whose predicted token is a repeat (`repeated_tokens`) counts `repeat_weight` times (1: as any).
    Returns (loss, metrics: per-step CE and top-1 agreement with the target argmax).
    """
    k = len(weights)
    rows = rows if rows is not None else target_rows(shared, batch, repeats=repeat_weight != 1.0)
    repeated = rows.repeated if repeat_weight != 1.0 else None
    if repeat_weight != 1.0 and repeated is None:
        raise ValueError("repeat_weight needs rows from target_rows(..., repeats=True)")
    rb, rq = rows.rb, rows.rq
    metrics: dict[str, float] = {}
    if rb.numel() == 0:
        zero = torch.stack([p.sum() for p in head.parameters()]).sum() * 0.0
        return zero, metrics
    tgt_prob = draft_distribution(head, rows.prob)
    outs = head_unrolled(head, shared, batch.ids, batch.features_for(head.feature_layers), steps=k)
    steps: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
    for j, w in enumerate(weights, start=1):
        sel = rq >= batch.response_start[rb] + j - 2
        if sel.any():
            logp = torch.log_softmax(head.logits(shared, outs[j - 1][rb[sel], rq[sel]]), dim=-1)
            steps.append((j, w, sel, logp))
    hits = [(rb[sel], rq[sel], head.token_ids(logp.argmax(-1)) == rows.argmax[sel]) for _, _, sel, logp in steps]
    on_path = decoding_path_mask(batch, hits) if path_weight > 0 else None
    total = torch.zeros((), device=batch.ids.device)
    wsum = 0.0
    for (j, w, sel, logp), (b, q, hit) in zip(steps, hits, strict=True):
        ce_rows = -(tgt_prob[sel] * logp).sum(-1)
        if on_path is None and repeated is None:
            ce = ce_rows.mean()
        else:
            row_w = torch.ones_like(ce_rows)
            if on_path is not None:
                row_w = row_w + path_weight * on_path[b, q - j + 1].float()
            if repeated is not None:
                row_w = row_w * torch.where(repeated[sel], repeat_weight, 1.0)
            ce = (row_w * ce_rows).sum() / row_w.sum().clamp_min(1e-9)
        total = total + w * ce
        wsum += w
        metrics[f"ce{j}"] = float(ce.detach())
        metrics[f"acc{j}"] = float(hit.float().mean())
    loss = total / max(wsum, 1e-9)
    metrics["loss"] = float(loss.detach())
    return loss, metrics
