"""The decoding-path acceptance figure of the trainer's evaluation equals what the engine counts online.

Teacher-forced evaluation scores a chain from every response position; decoding starts a chain only where
the previous one stopped. `online_chains` follows decoding's path through the teacher-forced counts, so on
the target's own greedy responses it must reproduce the engine's speculation counters exactly.
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.cluster.engine.chat_encoding import encode_text
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.train.batches import HiddenStore
from mtpserve.speculative.train.data import TokenDataset
from mtpserve.speculative.train.dense import head_unrolled
from mtpserve.speculative.train.eval import accepted_runs, evaluate, online_chains, path_bases
from mtpserve.speculative.train.loss import decoding_path_mask, target_rows, unrolled_loss
from mtpserve.speculative.train.trainer import build_shared
from mtpserve.workers.builders import DEFAULT_HEAD
from tests.helpers.smol import CHAT_PROMPTS, smollm2
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine

K = 3


def test_online_chains_follow_the_decoding_path() -> None:
    """Each chain starts one past the drafts the previous one accepted; the token cap stops the walk."""
    run = [2, 0, 3, 1, 0, 0, 3, 2, 1, 0, 0, 0]
    # bases visited from 0: 0 (+2) -> 3 (+1) -> 5 (+0) -> 6 (+3) -> 10 (+0) -> 11 (+0)
    assert online_chains(run, 0, 11) == (6, 6)
    assert online_chains(run, 0, 9) == (4, 6)  # base 10 is past the last whole chain
    assert online_chains(run, 1, 11) == (5, 6)  # 1 (+0) -> 2 (+3) -> 6 (+3) -> 10 (+0) -> 11 (+0)
    # The prompt step emits one token, each chain 1 + accepted: 1, 4, 6, 7, 11 emitted before chains 1..5.
    assert online_chains(run, 0, 11, max_tokens=7) == (3, 3)
    assert online_chains(run, 0, 11, max_tokens=8) == (4, 6)
    assert online_chains(run, 0, 11, max_tokens=1) == (0, 0)


def greedy_dataset(
    args: LlamaArgs, weights: dict[str, torch.Tensor], prompts: list[list[int]], length: int
) -> TokenDataset:
    """Each prompt with the target's greedy answer of `length` tokens (target-only engine)."""
    plain = tiny_engine(args, weights)
    outs = plain.generate(prompts, {"max_tokens": length, "temperature": 0.0, "ignore_eos": True})
    plain.shutdown()
    return TokenDataset(
        [torch.tensor(p + o.token_ids) for p, o in zip(prompts, outs, strict=True)],
        [len(p) for p in prompts],
        [True] * len(prompts),
        ["probe"] * len(prompts),
    )


def mimic_batch(n: int = 6, length: int = 40) -> tuple[LlamaArgs, dict[str, torch.Tensor], MTPEagleHead, TokenDataset]:
    """A mimic target, its head and greedy answers of `length` tokens to `n` random prompts."""
    args, w = mimic_target(seed=3)
    prompts = random_prompts(n, args.vocab_size, [5, 9, 14], seed=4)
    return args, w, mimic_head(args, w), greedy_dataset(args, w, prompts, length)


def check_against_engine(
    args: LlamaArgs, weights: dict[str, torch.Tensor], head: MTPEagleHead, prompts: list[list[int]], length: int
) -> tuple[int, int, dict[str, float]]:
    """Engine counters vs `online_chains` per prompt; returns total (chains, accepted) and the evaluation."""
    ds = greedy_dataset(args, weights, prompts, length)
    shared = build_shared(args, weights, "cpu", torch.float32)
    store = HiddenStore(shared, ds, torch.device("cpu"), layers=head.feature_layers)
    idx = list(range(len(ds)))
    run, _ = accepted_runs(head.eval(), shared, store.batch(idx), K)
    cap = length - K - 1  # every chain the engine runs under this cap lies inside the stored responses
    spec = tiny_engine(args, weights, head, speculative={"num_draft_tokens": K})
    totals = [0, 0]
    for b, prompt in enumerate(prompts):
        (done,) = spec.generate([prompt], {"max_tokens": cap, "temperature": 0.0, "ignore_eos": True})
        want = online_chains(run[b].tolist(), len(prompt) - 1, len(prompt) + length - 1 - K, max_tokens=cap)
        assert (done.stats.verify_steps, done.stats.accepted) == want, f"prompt {b}"
        assert done.stats.drafted == K * want[0]
        totals[0] += want[0]
        totals[1] += want[1]
    spec.shutdown()
    res = evaluate(head, shared, store, idx, K, first_tokens=cap)
    assert (res["first_chains"], res["first_tokens"]) == (totals[0], cap), "the window is the engine's max_tokens"
    assert res["first_acceptance_length"] == pytest.approx(1 + totals[1] / totals[0])
    return totals[0], totals[1], res


def test_decoding_path_matches_the_engine_on_a_tiny_target() -> None:
    """Mimic target and head (high but imperfect acceptance): same chains, same accepted drafts."""
    args, w = mimic_target(seed=3)
    head = mimic_head(args, w)
    prompts = random_prompts(6, args.vocab_size, [5, 9, 14], seed=4)
    chains, accepted, res = check_against_engine(args, w, head, prompts, 48)
    assert 0 < accepted < K * chains  # both accepted and rejected drafts
    assert res["online_chains"] > 0 and res["online_acceptance_length"] > 1.0


@pytest.mark.slow
def test_decoding_path_matches_the_engine_on_smollm2_with_the_shipped_head() -> None:
    """SmolLM2 fp32 with the default head on chat prompts; the figure along the path is below the average
    over every position (misses cost a step each, accepted runs are crossed in one)."""
    _, args, w, tok = smollm2()
    head = MTPEagleHead.load(DEFAULT_HEAD, args)
    prompts = [encode_text(tok, p) for p in CHAT_PROMPTS]
    chains, accepted, res = check_against_engine(args, w, head, prompts, 64)
    assert 0 < accepted < K * chains
    assert res["online_acceptance_length"] < res["acceptance_length"]


def test_loss_path_mask_is_the_evaluation_path() -> None:
    """The loss's decoding-path bases (from per-row hits) are the bases the evaluation walks (from whole
    chains), on every sequence of a batch."""
    args, w, head, ds = mimic_batch()
    shared = build_shared(args, w, "cpu", torch.float32)
    batch = HiddenStore(shared, ds, torch.device("cpu"), layers=head.feature_layers).batch(list(range(len(ds))))
    rows = target_rows(shared, batch)
    outs = head_unrolled(head.eval(), shared, batch.ids, batch.features_for(head.feature_layers), steps=K)
    hits = []
    for j in range(1, K + 1):
        sel = rows.rq >= batch.response_start[rows.rb] + j - 2
        drafts = head.greedy_tokens(shared, outs[j - 1][rows.rb[sel], rows.rq[sel]])
        hits.append((rows.rb[sel], rows.rq[sel], drafts == rows.argmax[sel]))
    mask = decoding_path_mask(batch, hits)
    run, _ = accepted_runs(head, shared, batch, K)
    chains = accepted = 0
    for b in range(len(ds)):
        r, n = int(batch.response_start[b]), int(batch.lengths[b])
        want = path_bases(run[b].tolist(), r - 1, n - 1 - K)
        got = mask[b].nonzero().flatten().tolist()
        assert got[: len(want)] == want and len(want) > 3, b  # the loss walks on to base n - 3
        chains += len(want)
        accepted += sum(int(run[b, p]) for p in want)
    assert 0 < accepted < K * chains  # both hits and misses on the path


def test_path_weight_moves_the_loss_toward_the_decoding_path() -> None:
    """Weight 0 is the plain loss; a large weight approaches the loss of the decoding path's chains alone,
    which differs from the plain one; the gradient flows either way."""
    args, w, head, ds = mimic_batch()
    shared = build_shared(args, w, "cpu", torch.float32)
    batch = HiddenStore(shared, ds, torch.device("cpu"), layers=head.feature_layers).batch(list(range(len(ds))))
    weights = [1.0, 0.7, 0.49]
    plain, _ = unrolled_loss(head, shared, batch, weights)
    zero, _ = unrolled_loss(head, shared, batch, weights, path_weight=0.0)
    one, _ = unrolled_loss(head, shared, batch, weights, path_weight=1.0)
    big, _ = unrolled_loss(head, shared, batch, weights, path_weight=1e6)
    huge, _ = unrolled_loss(head, shared, batch, weights, path_weight=1e9)
    f = {
        name: float(v.detach())
        for name, v in [("plain", plain), ("zero", zero), ("one", one), ("big", big), ("huge", huge)]
    }
    assert f["zero"] == f["plain"]
    assert abs(f["big"] - f["huge"]) < 1e-4 * f["huge"]
    assert abs(f["big"] - f["plain"]) > 1e-3
    lo, hi = sorted((f["plain"], f["big"]))
    assert lo < f["one"] < hi
    one.backward()
    assert head.eh_proj.weight.grad is not None and float(head.eh_proj.weight.grad.abs().sum()) > 0
