"""The unrolled self-distillation loss: soft cross-entropy against the target's next-token distribution."""

from __future__ import annotations

import torch

from speculative.mtp_head import MTPEagleHead
from speculative.train.batches import Batch
from speculative.train.dense import head_unrolled
from workers.model import LlamaModel


def default_step_weights(k: int, decay: float = 0.7) -> list[float]:
    """Loss weight per unrolled step: 1, 0.7, 0.49, ..."""
    return [decay**i for i in range(k)]


def unrolled_loss(
    head: MTPEagleHead,
    shared: LlamaModel,
    batch: Batch,
    weights: list[float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted mean over steps of soft CE(target p at row q+1, draft at row q), on response positions.

    Step k's row q belongs to the chain from base p = q - k + 1; rows count when p >= response_start - 1
    (the first base at inference is the prompt's last token) and the predicted token q + 2 lies in the
    sequence. Returns (loss, metrics: per-step CE and top-1 agreement with the target argmax).
    """
    k = len(weights)
    ids, hidden = batch.ids, batch.hidden
    q = torch.arange(ids.shape[1], device=ids.device)[None, :]
    r = batch.response_start[:, None]
    valid = (q >= r - 1) & (q <= batch.lengths[:, None] - 3)
    rb, rq = valid.nonzero(as_tuple=True)
    metrics: dict[str, float] = {}
    if rb.numel() == 0:
        zero = torch.stack([p.sum() for p in head.parameters()]).sum() * 0.0
        return zero, metrics
    with torch.no_grad():
        tgt_logits = shared.logits(hidden[rb, rq + 1])
        tgt_prob = torch.softmax(tgt_logits, dim=-1)
        tgt_arg = tgt_logits.argmax(-1)
        del tgt_logits
    outs = head_unrolled(head, shared, ids, hidden, k)
    total = torch.zeros((), device=ids.device)
    wsum = 0.0
    for j, w in enumerate(weights, start=1):
        sel = rq >= batch.response_start[rb] + j - 2
        if not sel.any():
            continue
        logp = torch.log_softmax(shared.logits(outs[j - 1][rb[sel], rq[sel]]), dim=-1)
        ce = -(tgt_prob[sel] * logp).sum(-1).mean()
        total = total + w * ce
        wsum += w
        metrics[f"ce{j}"] = float(ce.detach())
        metrics[f"acc{j}"] = float((logp.argmax(-1) == tgt_arg[sel]).float().mean())
    loss = total / max(wsum, 1e-9)
    metrics["loss"] = float(loss.detach())
    return loss, metrics
