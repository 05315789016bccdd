"""Verification keeps the target's distribution: rejection sampling for sampled drafts, the target's keyed draws for
deterministic ones, with accept rates that match theory."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from mtpserve.speculative.verify import verify, verify_greedy

V = 6
TRIALS = 40_000


def expected(p: torch.Tensor, counts: torch.Tensor):
    """Expected counts under p, summing exactly to the observed total."""
    pd = p.double() / p.double().sum()
    return (pd * counts.sum()).numpy()


def _dists() -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = torch.tensor([0.02, 0.05, 0.08, 0.15, 0.30, 0.40])  # deliberately unlike p
    return p, q


def test_first_token_distribution_and_accept_rate() -> None:
    p, q = _dists()
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=g)[:, None]  # [N, 1]
    target = torch.stack([p, p])[None].expand(TRIALS, 2, V)
    u = torch.rand(TRIALS, 2, generator=g)
    n_acc, tokens = verify(target, drafts, u, q[None, None].expand(TRIALS, 1, V))
    first = tokens[:, 0]
    counts = torch.bincount(first, minlength=V).double()
    _, pvalue = chisquare(counts.numpy(), expected(p, counts))
    assert pvalue > 1e-3
    theory = torch.minimum(p, q).sum().item()  # P(accept) = sum_x min(p(x), q(x))
    rate = n_acc.double().mean().item()
    assert abs(rate - theory) < 4 * (theory * (1 - theory) / TRIALS) ** 0.5 + 1e-3


def test_one_hot_drafts_with_sampled_target() -> None:
    p, _ = _dists()
    g = torch.Generator().manual_seed(1)
    drafts = torch.full((TRIALS, 1), 4)  # a deterministic (greedy) draft proposing token 4
    target = torch.stack([p, p])[None].expand(TRIALS, 2, V)
    n_acc, tokens = verify(target, drafts, torch.rand(TRIALS, 2, generator=g), None)
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    _, pvalue = chisquare(counts.numpy(), expected(p, counts))
    assert pvalue > 1e-3
    assert abs(n_acc.double().mean().item() - p[4].item()) < 0.01


def test_second_position_is_conditioned_correctly() -> None:
    """With two drafts, the token emitted at position 2 (given position 1 accepted) follows p_2."""
    p1, q = _dists()
    p2 = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    g = torch.Generator().manual_seed(2)
    d = torch.multinomial(q, 2 * TRIALS, replacement=True, generator=g).view(TRIALS, 2)
    target = torch.stack([p1, p2, p2])[None].expand(TRIALS, 3, V)
    qq = q[None, None].expand(TRIALS, 2, V)
    n_acc, tokens = verify(target, d, torch.rand(TRIALS, 3, generator=g), qq)
    second = tokens[n_acc >= 1, 1]
    counts = torch.bincount(second, minlength=V).double()
    _, pvalue = chisquare(counts.numpy(), expected(p2, counts))
    assert pvalue > 1e-3


def test_greedy_accepts_longest_matching_prefix_plus_bonus() -> None:
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [0, 2, 3]])
    n, tokens = verify_greedy(argmax, drafts)
    assert n.tolist() == [3, 1, 0]
    emitted = [tokens[i, : n[i] + 1].tolist() for i in range(3)]
    assert emitted == [[5, 6, 7, 8], [5, 6], [1]]
    one_hot = torch.nn.functional.one_hot(argmax, 10).float()
    n2, tokens2 = verify(one_hot, drafts, torch.rand(3, 4), None)
    assert n2.tolist() == n.tolist()
    assert [tokens2[i, : n2[i] + 1].tolist() for i in range(3)] == emitted


def test_deterministic_drafts_emit_the_targets_own_draws() -> None:
    """With drafts chosen deterministically, a step emits the target's inverse-CDF draws at its rows, and
    accepts exactly the drafts that equal them: the output does not depend on the drafts."""
    from mtpserve.speculative.sampling import sample_at_threshold

    g = torch.Generator().manual_seed(3)
    n, k = 2_000, 3
    target = torch.softmax(2 * torch.randn(n, k + 1, V, generator=g), dim=-1)
    u = torch.rand(n, k + 1, generator=g)
    draws = sample_at_threshold(target, u)
    keep = torch.rand(n, k, generator=g) < 0.6  # drafts that equal the draws, others shifted away from them
    drafts = torch.where(keep, draws[:, :k], (draws[:, :k] + 1) % V)
    n_acc, tokens = verify(target, drafts, u, None)
    want = torch.cumprod(keep.long(), dim=1).sum(dim=1)
    assert n_acc.tolist() == want.tolist()
    for b in range(n):
        assert tokens[b, : int(n_acc[b]) + 1].tolist() == draws[b, : int(n_acc[b]) + 1].tolist()
    assert 0 < int(n_acc.sum()) < n * k


def test_second_position_with_deterministic_drafts() -> None:
    """Greedy drafts (token 1 then token 3): the token emitted at position 2, given position 1 accepted,
    follows p_2, and position 2 is accepted with probability p_2(3)."""
    p1, _ = _dists()
    p2 = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    g = torch.Generator().manual_seed(4)
    drafts = torch.tensor([[1, 3]]).expand(TRIALS, 2)
    target = torch.stack([p1, p2, p2])[None].expand(TRIALS, 3, V)
    n_acc, tokens = verify(target, drafts, torch.rand(TRIALS, 3, generator=g), None)
    second = tokens[n_acc >= 1, 1]
    counts = torch.bincount(second, minlength=V).double()
    _, pvalue = chisquare(counts.numpy(), expected(p2, counts))
    assert pvalue > 1e-3
    rate = (n_acc[n_acc >= 1] == 2).double().mean().item()
    assert abs(rate - p2[3].item()) < 0.02


def test_keyed_uniforms_are_uniform_and_a_function_of_key_and_position() -> None:
    """The keyed thresholds pass a Kolmogorov-Smirnov test along positions and across keys, repeat for the
    same key and position, and differ between neighbouring keys."""
    from scipy.stats import kstest

    from mtpserve.speculative.sampling import keyed_thresholds, sampling_key

    key = sampling_key(1234)
    assert key == sampling_key(1234) != sampling_key(1235)
    along = keyed_thresholds(torch.tensor([[key]]), torch.arange(50_000)[None])[0]
    across = keyed_thresholds(torch.tensor([sampling_key(s) for s in range(20_000)]), torch.tensor(77))
    for u in (along, across):
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        assert kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    again = keyed_thresholds(torch.tensor([[key]]), torch.arange(100)[None])[0]
    assert torch.equal(again, along[:100])
    assert float(torch.corrcoef(torch.stack([along[:-1], along[1:]]))[0, 1]) < 0.02
