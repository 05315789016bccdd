"""The `repeat=W` loss weight: which response tokens repeat an earlier n-gram of their answer, and a weight
that takes those rows out of the loss (0), leaves it unchanged (1) or counts them more."""

from __future__ import annotations

import pytest
import torch

from bench.probes.answer_length import main as answer_length_main
from bench.probes.answer_length import measure
from mtpserve.speculative.train.batches import HiddenStore, pad_ids
from mtpserve.speculative.train.eval import evaluate
from mtpserve.speculative.train.loss import repeated_tokens, target_rows, unrolled_loss
from mtpserve.speculative.train.trainer import build_shared
from tests.speculative.test_online_acceptance import mimic_batch


def token_view(seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids, lengths and response starts (all the n-gram check reads)."""
    ids = pad_ids([torch.tensor(s) for s in seqs], "cpu")
    return ids, torch.tensor([len(s) for s in seqs]), torch.tensor(starts)


def reference(seq: list[int], start: int, n: int) -> list[bool]:
    """Written out: token t repeats when seq[t-n+1 : t+1] (inside the response) appeared before t."""
    out = [False] * len(seq)
    for t in range(start + n - 1, len(seq)):
        gram = seq[t - n + 1 : t + 1]
        out[t] = any(seq[u - n + 1 : u + 1] == gram for u in range(start + n - 1, t))
    return out


def test_repeated_tokens_match_the_written_out_rule() -> None:
    g = torch.Generator().manual_seed(0)
    loop = [5, 6, 7, 8]
    seqs = [
        [1, 2, 5, 6, 7, 8] + loop * 4 + [9],  # a loop in the response
        [5, 6, 7, 8, 5, 6, 7, 8, 3, 4],  # the same 4-gram, but its first occurrence is in the prompt
        torch.randint(0, 6, (40,), generator=g).tolist(),  # chance repeats of a small alphabet
    ]
    starts = [2, 4, 3]
    for n in (2, 4):
        got = repeated_tokens(*token_view(seqs, starts), n)
        for b, (s, r) in enumerate(zip(seqs, starts, strict=True)):
            assert got[b, : len(s)].tolist() == reference(s, r, n), (n, b)
            assert not got[b, len(s) :].any()
        assert got[0].sum() > 8 and not got[1].any()
    assert repeated_tokens(*token_view(seqs, starts), 2)[2].any(), "36 bigrams, 39 positions: some repeat"


def test_repeat_weight_one_is_the_plain_loss_and_zero_ignores_repeated_rows() -> None:
    """Weight 1 is the plain loss; with weight 0 the target's distribution at repeated rows no longer matters,
    while with weight 1 it does."""
    args, w, head, ds = mimic_batch(length=40)
    loop = ds.ids[0][ds.response_start[0] : ds.response_start[0] + 6]
    ds.ids[0] = torch.cat([ds.ids[0], loop.repeat(4)])  # give one answer a loop of 6 tokens
    shared = build_shared(args, w, "cpu", torch.float32)
    batch = HiddenStore(shared, ds, torch.device("cpu"), layers=head.feature_layers).batch(list(range(len(ds))))
    weights = [1.0, 0.7, 0.49]
    rows = target_rows(shared, batch, repeats=True)
    repeated = repeated_tokens(batch.ids, batch.lengths, batch.response_start)[rows.rb, rows.rq + 2]
    assert rows.repeated is not None and torch.equal(rows.repeated, repeated)
    assert 0 < int(repeated.sum()) < repeated.numel()
    changed = target_rows(shared, batch, repeats=True)
    changed.prob[repeated] = torch.softmax(torch.randn(int(repeated.sum()), args.vocab_size), -1)

    def loss(r: object, weight: float) -> float:
        return float(unrolled_loss(head, shared, batch, weights, rows=r, repeat_weight=weight)[0].detach())  # type: ignore[arg-type]

    assert loss(rows, 1.0) == float(unrolled_loss(head, shared, batch, weights, rows=rows)[0].detach())
    assert abs(loss(rows, 0.0) - loss(changed, 0.0)) < 1e-6
    assert abs(loss(rows, 1.0) - loss(changed, 1.0)) > 1e-3
    assert abs(loss(rows, 0.0) - loss(rows, 1.0)) > 1e-4


def test_answer_length_bench_cuts_answers_and_scores_each_cut() -> None:
    """`bench/probes/answer_length.py`: whole answers score what the evaluation scores; a cut keeps that many
    response tokens per answer; bad cuts are refused."""
    args, w, head, ds = mimic_batch(length=40)
    shared = build_shared(args, w, "cpu", torch.float32)
    figures = measure(ds, head, shared, [12, 0], 3)
    store = HiddenStore(shared, ds, torch.device("cpu"), layers=head.feature_layers)
    whole = evaluate(head, shared, store, list(range(len(ds))), 3, batch_size=8)
    assert figures["0"]["decoding_path"] == pytest.approx(whole["online_acceptance_length"])
    assert figures["0"]["response_tokens"] == 40 * len(ds) and figures["12"]["response_tokens"] == 12 * len(ds)
    assert figures["12"]["decoding_path"] != figures["0"]["decoding_path"]
    assert all(0.0 <= f["repeated_share"] <= 1.0 for f in figures.values())
    for bad in ("a,b", "-1"):
        with pytest.raises(SystemExit):
            answer_length_main(["unused", "--head", "unused", "--cuts", bad])
