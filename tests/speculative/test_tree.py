"""Draft trees: one masked target pass scores every branch as a sequential pass would, greedy acceptance
over the tree equals greedy decoding, and top-k expansion keeps a well-formed tree within its budget."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mtpserve.modeling.model import DecoderLayer, LlamaModel
from mtpserve.speculative.train.dense import decoder_layer
from mtpserve.speculative.tree import (
    DraftTree,
    expand_topk,
    greedy_accept,
    greedy_walk,
    sample_accept,
    tree_draws,
)
from tests.helpers.tiny import random_prompts, tiny_args, tiny_weights


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    """The tiny fp32 target."""
    args = tiny_args()
    m = LlamaModel(args)
    m.load_hf_state_dict(tiny_weights(args))
    return m.eval()


@torch.no_grad()
def logits(model: LlamaModel, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Logits [L, V] of one sequence of ids [L] at the given positions, under a bool [L, L] mask (None: causal)."""
    x = model.embed(ids[None])
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        x, _ = decoder_layer(layer, model.rotary, x, positions, mask)
    return model.logits(x)[0]


def tree_pass(model: LlamaModel, prefix: list[int], tree: DraftTree) -> torch.Tensor:
    """Logits [N, V] of the tree's nodes from one pass over prefix + nodes with the tree mask."""
    n, length = tree.size, len(prefix)
    mask = torch.zeros(length + n, length + n, dtype=torch.bool)
    mask[:length, :length] = torch.tril(torch.ones(length, length, dtype=torch.bool))
    mask[length:, :length] = True
    mask[length:, length:] = tree.ancestor_mask()
    ids = torch.cat([torch.tensor(prefix), tree.tokens])
    positions = torch.cat([torch.arange(length), tree.positions(length)])
    return logits(model, ids, positions, mask)[length:]


def path_of(tree: DraftTree, node: int) -> list[int]:
    """Tokens from the root to `node`, both included."""
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


def random_tree(rng: random.Random, root: int, vocab: int, n: int, plant: list[int]) -> DraftTree:
    """A random tree of n drafted nodes with the chain `plant` below the root, siblings distinct."""
    tokens, parents = [root], [-1]
    for i, t in enumerate(plant):
        tokens.append(t)
        parents.append(i)
    while len(tokens) < n + 1:
        p = rng.randrange(len(tokens))
        t = rng.randrange(vocab)
        if any(parents[j] == p and tokens[j] == t for j in range(1, len(tokens))):
            continue
        tokens.append(t)
        parents.append(p)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def path_score(table: torch.Tensor, path: tuple[int, ...]) -> float:
    """Cumulative draft log-probability of a root-to-node path under a next-token table."""
    return sum(float(table[a, b]) for a, b in itertools.pairwise(path))


def greedy_continuation(model: LlamaModel, prefix: list[int], n: int) -> list[int]:
    """n greedy tokens after prefix, one full causal pass per token."""
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(logits(model, torch.tensor(seq), torch.arange(len(seq)), None)[-1].argmax()))
    return seq[len(prefix) :]


@pytest.mark.parametrize("seed", range(4))
def test_one_tree_pass_scores_every_branch_like_a_sequential_pass(model: LlamaModel, seed: int) -> None:
    """Each node's logits from the masked tree pass equal the last row of a causal pass over prefix + its
    path (fp32, <= 1e-5)."""
    rng = random.Random(seed)
    vocab = tiny_args().vocab_size
    prefix = random_prompts(1, vocab, [rng.randint(1, 12)], seed=seed)[0]
    tree = random_tree(rng, rng.randrange(vocab), vocab, n=rng.randint(1, 14), plant=[])
    got = tree_pass(model, prefix, tree)
    for node in range(tree.size):
        seq = prefix + path_of(tree, node)
        want = logits(model, torch.tensor(seq), torch.arange(len(seq)), None)[-1]
        assert torch.allclose(got[node], want, atol=1e-5, rtol=0), (node, (got[node] - want).abs().max())


@pytest.mark.parametrize("seed", range(6))
def test_greedy_acceptance_over_the_tree_is_greedy_decoding(model: LlamaModel, seed: int) -> None:
    """With the greedy continuation planted to a random depth among random branches, the walk accepts
    exactly that prefix and its bonus is the next greedy token; the output equals target-only greedy."""
    rng = random.Random(100 + seed)
    vocab = tiny_args().vocab_size
    prompt = random_prompts(1, vocab, [rng.randint(2, 10)], seed=50 + seed)[0]
    prefix, root = prompt[:-1], prompt[-1]
    truth = greedy_continuation(model, prompt, 6)
    planted = truth[: rng.randint(0, 4)]
    tree = random_tree(rng, root, vocab, n=len(planted) + rng.randint(0, 10), plant=planted)
    argmax = tree_pass(model, prefix, tree).argmax(-1)
    path, bonus = greedy_accept(tree, argmax)
    emitted = [int(tree.tokens[i]) for i in path] + [bonus]
    assert len(path) >= len(planted)
    assert emitted == truth[: len(emitted)]
    for i in path:  # the walk follows parent links from the root
        assert int(tree.parents[i]) == ([0, *path][path.index(i)])


def test_a_chain_tree_is_the_chain_rule() -> None:
    """On a chain the walk is the longest matching prefix plus the bonus."""
    chain = DraftTree(torch.tensor([9, 4, 5, 6]), torch.tensor([-1, 0, 1, 2]))
    assert greedy_accept(chain, torch.tensor([4, 5, 7, 1])) == ([1, 2], 7)
    assert greedy_accept(chain, torch.tensor([3, 5, 6, 8])) == ([], 3)
    assert greedy_accept(chain, torch.tensor([4, 5, 6, 8])) == ([1, 2, 3], 8)


def test_tree_checks_and_masks() -> None:
    """Malformed trees are refused with the reason; depth, positions and mask follow the parent links."""
    with pytest.raises(ValueError, match="parents\\[0\\]"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="\\[0, i\\)"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="distinct"):
        DraftTree(torch.tensor([1, 2, 2]), torch.tensor([-1, 0, 0]))
    t = DraftTree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 3]))
    assert t.depth().tolist() == [0, 1, 1, 2, 3]
    assert t.positions(10).tolist() == [10, 11, 11, 12, 13]
    m = t.ancestor_mask()
    assert m[4].tolist() == [True, True, False, True, True] and m[2].tolist() == [True, False, True, False, False]


@pytest.mark.parametrize(("width", "depth", "budget"), [(1, 3, 3), (2, 3, 5), (3, 4, 10), (4, 2, 30)])
def test_expand_topk_keeps_the_best_nodes_in_a_well_formed_tree(width: int, depth: int, budget: int) -> None:
    """Within budget; ancestor-closed and topological (DraftTree checks); no deeper than `depth`; each kept
    node's cumulative draft log-probability is at least that of any node grown in an earlier round and left
    out; width 1 is the draft's greedy chain."""
    vocab = 40
    g = torch.Generator().manual_seed(width * 100 + depth)
    table = torch.log_softmax(3 * torch.randn(vocab, vocab, generator=g), dim=-1)  # next-token table
    seen: dict[tuple[int, ...], float] = {}

    def logprobs_of(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        for node in range(tree.size):  # every node grown in the rounds so far
            path = tuple(path_of(tree, node))
            seen.setdefault(path, path_score(table, path))
        return table[tree.tokens[nodes]]

    tree = expand_topk(7, logprobs_of, width, depth, budget=budget)
    assert tree.size - 1 <= budget and int(tree.depth().max()) <= depth
    score = {tuple(path_of(tree, i)): 0.0 for i in range(tree.size)}
    for path in score:
        score[path] = path_score(table, path)
    kept_min = min(v for p, v in score.items() if len(p) > 1)
    dropped = [v for p, v in seen.items() if p not in score and len(p) > 1]
    assert all(v <= kept_min + 1e-6 for v in dropped)
    if width == 1:
        chain, tok = [7], 7
        for _ in range(depth):
            tok = int(table[tok].argmax())
            chain.append(tok)
        assert tree.tokens.tolist() == chain[: tree.size]


def first_token_counts(p: torch.Tensor, q: torch.Tensor, m: int, trials: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token over `trials` trees of m children drawn from q without replacement."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    counts = torch.zeros(vocab, dtype=torch.float64)
    leaf = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(trials):
        kids = torch.multinomial(q, m, replacement=False, generator=g)
        tree = DraftTree(torch.cat([torch.tensor([0]), kids]), torch.tensor([-1] + [0] * m))
        target = torch.stack([p] + [leaf] * m)
        draft = torch.stack([q] + [leaf] * m)
        path, bonus = sample_accept(tree, target, draft, g)
        counts[int(tree.tokens[path[0]]) if path else bonus] += 1
    return counts


@pytest.mark.parametrize(("m", "seed"), [(1, 0), (3, 1), (5, 2)])
def test_tree_rejection_sampling_keeps_the_target_distribution(m: int, seed: int) -> None:
    """With m candidate children drawn without replacement from the draft, the first emitted token follows
    the target's distribution (chi-square, 20,000 trials, fixed seed)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(100 + seed)
    vocab = 7
    p = torch.softmax(2 * torch.randn(vocab, generator=g, dtype=torch.float64), dim=0)
    q = torch.softmax(2 * torch.randn(vocab, generator=g, dtype=torch.float64), dim=0)
    trials = 20_000
    counts = first_token_counts(p, q, m, trials, seed)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3, (counts / trials, p)


def test_rejection_sampling_with_the_draft_as_the_target_accepts_the_first_child() -> None:
    """p == q: the first candidate is always accepted, at every level of a chain."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 9, generator=g), dim=-1).double()
    chain = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]))
    for _ in range(50):
        path, _ = sample_accept(chain, probs, probs, g)
        assert path == [1, 2, 3]


def test_a_wrong_residual_would_be_caught() -> None:
    """The chi-square check can fail: resampling the bonus from the target itself (no residual) skews the
    distribution of the first token when the draft is far from the target."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(7)
    p = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=torch.float64)
    trials, counts = 20_000, torch.zeros(4)
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=g))
        accept = float(torch.rand((), generator=g)) * float(q[x]) < float(p[x])
        counts[x if accept else int(torch.multinomial(p, 1, generator=g))] += 1
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue < 1e-6


def candidate_counts(p: torch.Tensor, kids: list[int], trials: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Counts of the first emitted token over `trials` walks with fixed candidate children `kids` of the root,
    each over the target's draws from fresh thresholds, and how often each child was accepted."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    tree = DraftTree(torch.tensor([0, *kids]), torch.tensor([-1] + [0] * len(kids)))
    target = torch.stack([p] + [torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)] * len(kids))
    counts = torch.zeros(vocab, dtype=torch.float64)
    hits = [0] * len(kids)
    for _ in range(trials):
        u = torch.rand(2, generator=g, dtype=torch.float64)
        path, bonus = greedy_accept(tree, tree_draws(target, u, tree.depth()))
        if path:
            hits[path[0] - 1] += 1
        counts[int(tree.tokens[path[0]]) if path else bonus] += 1
    return counts, hits


@pytest.mark.parametrize(("kids", "seed"), [([3], 0), ([3, 0, 5], 1), ([6, 5, 4, 3, 2], 2)])
def test_fixed_candidates_keep_the_target_distribution(kids: list[int], seed: int) -> None:
    """Children chosen deterministically (the engine's top-k trees), walked over the target's draws: the first
    emitted token follows the target's distribution (chi-square, 20,000 trials), and each candidate is accepted
    with its target probability, as recursive rejection sampling over fixed candidates accepts it."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(200 + seed)
    p = torch.softmax(1.5 * torch.randn(7, generator=g, dtype=torch.float64), dim=0)
    trials = 20_000
    counts, hits = candidate_counts(p, kids, trials, seed)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3, (counts / trials, p)
    assert all(h > 0 for h in hits)
    assert sum(hits) == pytest.approx(trials * float(p[kids].sum()), rel=0.05)
    for kid, h in zip(kids, hits, strict=True):
        assert h == pytest.approx(trials * float(p[kid]), rel=0.1, abs=60)


def test_fixed_candidates_without_the_residual_would_be_caught() -> None:
    """The check can fail: accepting each later candidate with its unrenormalised target probability (no
    residual) skews the first token."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(9)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    trials, counts = 20_000, torch.zeros(4)
    for _ in range(trials):
        out = None
        for x in (0, 1):
            if float(torch.rand((), generator=g)) < float(p[x]):
                out = x
                break
        counts[out if out is not None else int(torch.multinomial(p, 1, generator=g))] += 1
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue < 1e-6


def test_batched_walks_match_the_per_tree_rules() -> None:
    """greedy_walk equals greedy_accept on random trees; the target's draws from one-hot distributions are the
    argmax (the greedy rule inside a sampling step), whatever the thresholds."""
    rng = random.Random(3)
    vocab, n, depth, width = 12, 9, 4, 3
    trees, argmaxes = [], []
    for _ in range(64):
        parents, tokens, kids = [-1], [rng.randrange(vocab)], {0: []}
        for i in range(1, n):
            options = [p for p in range(i) if len(kids[p]) < width and depth_of(parents, p) < depth]
            parent = rng.choice(options)
            used = {tokens[c] for c in kids[parent]}
            tokens.append(rng.choice([t for t in range(vocab) if t not in used]))
            parents.append(parent)
            kids[parent].append(i)
            kids[i] = []
        trees.append(DraftTree(torch.tensor(tokens), torch.tensor(parents)))
        want = torch.tensor([tokens[rng.choice(kids[i])] if kids[i] and rng.random() < 0.7 else 0 for i in range(n)])
        argmaxes.append(want)
    tok = torch.stack([t.tokens for t in trees])
    par = torch.stack([t.parents for t in trees])
    am = torch.stack(argmaxes)
    n_acc, path, bonus = greedy_walk(tok, par, am, depth)
    onehot = torch.nn.functional.one_hot(am, vocab).double()
    u = torch.rand(64, depth + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    node_depth = torch.stack([t.depth() for t in trees])
    s_acc, s_path, s_bonus = greedy_walk(tok, par, tree_draws(onehot, u, node_depth), depth)
    for b, tree in enumerate(trees):
        ref_path, ref_bonus = greedy_accept(tree, am[b])
        assert n_acc[b] == len(ref_path) == s_acc[b]
        assert path[b, : len(ref_path)].tolist() == ref_path == s_path[b, : len(ref_path)].tolist()
        assert bonus[b] == ref_bonus == s_bonus[b]
    assert 0 < int(n_acc.sum()) < 64 * depth


def depth_of(parents: list[int], node: int) -> int:
    """Distance of `node` from the root."""
    d = 0
    while parents[node] >= 0:
        node, d = parents[node], d + 1
    return d


@pytest.mark.parametrize(("kids", "seed"), [([3], 0), ([3, 0, 5], 1), ([6, 5, 4, 3], 2)])
def test_batched_sampling_walk_keeps_the_target_distribution(kids: list[int], seed: int) -> None:
    """greedy_walk over the target's draws (`tree_draws`) for 20,000 copies of a tree with fixed root children,
    in one batch: the first emitted token follows the target's distribution (chi-square)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(300 + seed)
    vocab, trials = 7, 20_000
    p = torch.softmax(1.5 * torch.randn(vocab, generator=g, dtype=torch.float64), dim=0)
    tok = torch.tensor([0, *kids]).expand(trials, -1)
    par = torch.tensor([-1] + [0] * len(kids)).expand(trials, -1)
    probs = torch.stack([p] + [torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)] * len(kids))
    u = torch.rand(trials, 2, generator=g, dtype=torch.float64)
    node_depth = torch.tensor([0] + [1] * len(kids)).expand(trials, -1)
    draws = tree_draws(probs.expand(trials, -1, -1), u, node_depth)
    n_acc, path, bonus = greedy_walk(tok, par, draws, 1)
    first = torch.where(n_acc > 0, tok.gather(1, path[:, :1])[:, 0], bonus)
    counts = torch.bincount(first, minlength=vocab).double()
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3, (counts / trials, p)


def test_prune_keeps_what_a_stable_sort_keeps() -> None:
    """`prune` (element-wise ranks, no sort) keeps, orders and renumbers the nodes a stable sort by score
    would, ties to the earlier node, on random trees with many tied scores."""
    from mtpserve.speculative.mtp_tree import prune

    def by_sorting(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int) -> tuple:
        order = torch.sort(-scores, dim=1, stable=True).indices[:, :budget]
        kept = torch.sort(order, dim=1).values
        renumber = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.long)
        renumber.scatter_(1, kept + 1, torch.arange(1, budget + 1).expand_as(kept))
        return tokens.gather(1, kept), renumber.gather(1, parents.gather(1, kept)), scores.gather(1, kept)

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, m = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 60, (1,), generator=g))
        budget = int(torch.randint(1, m + 1, (1,), generator=g))
        scores = torch.randint(-5, 1, (b, m), generator=g).float()
        tokens = torch.randint(0, 1000, (b, m), generator=g)
        parents = (torch.rand(b, m, generator=g) * torch.arange(1, m + 1)).long()  # parents[:, i] in [0, i]
        got, want = prune(tokens, parents, scores, budget), by_sorting(tokens, parents, scores, budget)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
