"""Prefix caching: block reuse by content key, and the draft head's coupling to the next token.

The property: a request whose prefix comes from the cache gets the same draft KV (fp32, 1e-5), the
same tokens and the same acceptance as the same request computed from scratch on an engine without
caching, for random shared prefixes, chunk sizes and preemptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtpserve.cluster.engine.prefix_cache as prefix_cache_module
from mtpserve.cluster.engine.block_manager import BlockManager
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.prefix_keys import ROOT_KEY, block_key, extend_keys, num_keyable_blocks
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.tiny import draft_kv, mimic_head, mimic_target, random_prompts, tiny_engine

BLOCK = 8  # tiny.engine_config's block size
ARGS, WEIGHTS = mimic_target()
HEAD = mimic_head(ARGS, WEIGHTS)


def engine(chunk: int, caching: bool, num_blocks: int = 256) -> LLMEngine:
    return tiny_engine(
        ARGS,
        WEIGHTS,
        HEAD,
        scheduler={
            "chunk_size": chunk,
            "max_num_batched_tokens": 64,
            "prefix_caching": caching,
            "num_kv_blocks": num_blocks,
        },
    )


def stats_of(out: Any) -> tuple[int, int, list[float]]:
    s = out.stats
    return s.drafted, s.accepted, list(s.accepted_per_position)


def due(req: Any, preempt_after: int | None) -> bool:
    """Whether to preempt `req` now: once, when it has generated at least `preempt_after` tokens."""
    if preempt_after is None or req.num_preemptions or req.finished or req.in_context:
        return False
    return len(req.output_token_ids) >= preempt_after


def alone(
    prompt: list[int], chunk: int, max_tokens: int, preempt_after: int | None = None
) -> tuple[list[int], tuple[int, int, list[float]], Any]:
    """Tokens, acceptance and prompt draft KV of one request on a fresh engine without caching."""
    eng = engine(chunk, caching=False)
    rid = eng.add_request(prompt, {"max_tokens": max_tokens})
    req = eng.scheduler.requests[rid]
    while req.in_context:
        eng.step()
    kv = draft_kv(eng, rid, len(prompt))
    final = None
    while eng.has_unfinished():
        if due(req, preempt_after):
            eng.scheduler.preempt(req)
        for o in eng.step():
            if o.finished:
                final = o
    assert final is not None
    return list(req.output_token_ids), stats_of(final), kv


def run_cached(
    eng: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, preempt: dict[int, int]
) -> tuple[dict[str, list[int]], dict[str, tuple[int, int, list[float]]], dict[str, torch.Tensor]]:
    """Run `prompts` together; preempt prompt i once it has generated preempt[i] tokens; record each
    prompt's draft KV right after its prefill, and its tokens and acceptance at the end."""
    rids = [eng.add_request(p, {"max_tokens": max_tokens}) for p in prompts]
    lengths = dict(zip(rids, map(len, prompts), strict=True))
    reqs = {rid: eng.scheduler.requests[rid] for rid in rids}
    kv: dict[str, torch.Tensor] = {}
    stats: dict[str, tuple[int, int, list[float]]] = {}
    while eng.has_unfinished():
        for i, after in preempt.items():
            if due(reqs[rids[i]], after):
                eng.scheduler.preempt(reqs[rids[i]])
        for out in eng.step():
            if out.finished:
                stats[out.request_id] = stats_of(out)
        for rid, req in reqs.items():
            if rid not in kv and not req.finished and not req.in_context and req.block_ids:
                kv[rid] = draft_kv(eng, rid, lengths[rid])
    tokens = {rid: list(r.output_token_ids) for rid, r in reqs.items()}
    return tokens, stats, kv


# ---- the block manager and the keys ---------------------------------------------------------------


def test_keys_cover_the_next_token_and_the_whole_prefix() -> None:
    a = list(range(1, 18))
    assert num_keyable_blocks(17, BLOCK) == 2 and num_keyable_blocks(16, BLOCK) == 1 and num_keyable_blocks(1, 8) == 0
    keys = extend_keys([], a, BLOCK, 2)
    assert keys[0] == block_key(ROOT_KEY, a[:9]) and keys[1] == block_key(keys[0], a[8:17])
    other_next = [*a[:8], 99, *a[9:]]
    assert extend_keys([], other_next, BLOCK, 1) != keys[:1], "block 0's key depends on token 8"
    other_start = [0, *a[1:]]
    assert extend_keys([], other_start, BLOCK, 2)[1] != keys[1], "block 1's key depends on block 0"
    assert extend_keys(list(keys[:1]), a[8:], BLOCK, 2) == keys, "extending reuses the keys it has"
    with pytest.raises(ValueError, match="known tokens"):
        extend_keys([], a[:16], BLOCK, 2)


def test_blocks_are_shared_counted_cached_and_evicted_least_recent_first() -> None:
    bm = BlockManager(4, BLOCK)
    a: list[int] = []
    assert bm.grow(a, 2 * BLOCK) and a == [0, 1]
    bm.register(a[0], b"k0")
    bm.register(a[1], b"k1")
    bm.register(a[1], b"other")  # a block keeps its first key
    shared = bm.match([b"k0", b"k1", b"k2"])
    assert shared == [0, 1] and bm.ref_count(0) == 2 and bm.num_free == 2
    bm.free(a)
    assert bm.num_free == 2 and bm.num_cached == 0, "still held by the second owner"
    bm.free(shared)
    assert bm.num_free == 4 and bm.num_cached == 2 and bm.num_keyed == 2
    c: list[int] = []
    assert bm.grow(c, 2 * BLOCK) and sorted(c) == [2, 3], "empty blocks go before cached ones"
    d: list[int] = []
    assert bm.grow(d, BLOCK) and d == [1], "the last block of a freed list is reused first"
    assert bm.match([b"k1"]) == [] and bm.match([b"k0"]) == [0]
    assert not bm.grow(d, 2 * BLOCK) and d == [1], "no change when short of blocks"
    assert bm.forget() == 1 and bm.match([b"k0"]) == []


# ---- the property ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix_len=st.integers(1, 40),
    cuts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=1, max_size=3),
    chunk=st.integers(1, 20),
    preempt_after=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 10_000),
)
def test_cache_hits_leave_draft_kv_tokens_and_acceptance_unchanged(
    prefix_len: int, cuts: list[tuple[int, int]], chunk: int, preempt_after: int | None, seed: int
) -> None:
    max_tokens = 14
    leader = random_prompts(1, ARGS.vocab_size, [prefix_len], seed=seed)[0]
    eng = engine(chunk, caching=True)
    first, _, _ = run_cached(eng, [leader], max_tokens, {})
    conversation = leader + next(iter(first.values()))
    followers = []
    for i, (cut, extra) in enumerate(cuts):
        tail = random_prompts(1, ARGS.vocab_size, [extra], seed=seed + 1 + i)[0] if extra else []
        followers.append(conversation[: max(1, min(cut, len(conversation)))] + tail)
    last = len(followers) - 1
    preempt = {} if preempt_after is None else {last: preempt_after}
    hits_before = eng.scheduler.prefix_hit_tokens
    tokens, stats, kv = run_cached(eng, followers, max_tokens, preempt)
    for i, (rid, prompt) in enumerate(zip(tokens, followers, strict=True)):
        want_tokens, want_stats, want_kv = alone(prompt, chunk, max_tokens, preempt.get(i))
        assert tokens[rid] == want_tokens
        assert stats[rid] == want_stats
        assert (kv[rid] - want_kv).abs().max().item() <= 1e-5
    f = followers[0]
    common = num_keyable_blocks(min(len(f), len(conversation)), BLOCK)
    expected = BLOCK * next(
        (b for b in range(common) if f[: (b + 1) * BLOCK + 1] != conversation[: (b + 1) * BLOCK + 1]), common
    )
    assert eng.scheduler.prefix_hit_tokens - hits_before >= expected, "the first follower reuses the leader's blocks"
    blocks = eng.scheduler.blocks
    assert not eng.has_unfinished() and blocks.num_free == blocks.num_blocks


def test_a_second_turn_starts_after_the_cached_conversation() -> None:
    eng = engine(16, caching=True)
    prompt = random_prompts(1, ARGS.vocab_size, [41], seed=3)[0]
    (first,) = eng.generate([prompt], {"max_tokens": 12})
    turn2 = prompt + first.token_ids + random_prompts(1, ARGS.vocab_size, [6], seed=4)[0]
    rid = eng.add_request(turn2, {"max_tokens": 4})
    plan = eng.scheduler.schedule()
    (sp,) = plan.seqs
    cached = num_keyable_blocks(len(prompt) + len(first.token_ids), BLOCK) * BLOCK
    assert sp.start == cached == 48, "prompt and reply blocks, all but the reply's last partial block"
    assert eng.scheduler.prefix_hit_tokens == cached and eng.scheduler.prefix_query_tokens == len(prompt) + len(turn2)
    eng.scheduler.abort(rid)
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_a_cache_that_ignores_the_next_token_corrupts_the_last_shared_draft_row(monkeypatch: Any) -> None:
    """Control: keys over a block's own tokens only (the naive scheme) share a block whose last draft row
    was computed from another request's next token; the property's check catches exactly that row."""

    def naive_keyable(num_tokens: int, block_size: int) -> int:
        return num_tokens // block_size

    def naive_keys(keys: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
        for j in range(num_blocks - len(keys)):
            keys.append(block_key(keys[-1] if keys else ROOT_KEY, token_ids[j * block_size : (j + 1) * block_size]))
        return keys

    shared = random_prompts(1, ARGS.vocab_size, [2 * BLOCK], seed=21)[0]
    a = [*shared, 5, 6, 7]
    b = [*shared, 50, 60, 70]
    _, _, want_kv = alone(b, 4, 8)
    for naive, bad_rows in [(False, set()), (True, {2 * BLOCK - 1})]:
        if naive:
            monkeypatch.setattr(prefix_cache_module, "num_keyable_blocks", naive_keyable)
            monkeypatch.setattr(prefix_cache_module, "extend_keys", naive_keys)
        eng = engine(4, caching=True)
        run_cached(eng, [a], 8, {})
        _, _, kv = run_cached(eng, [b], 8, {})
        rows = (next(iter(kv.values())) - want_kv).abs().amax(dim=(0, 2, 3))
        assert set(torch.nonzero(rows > 1e-5).flatten().tolist()) == bad_rows
        assert eng.scheduler.prefix_hit_tokens == (2 * BLOCK if naive else BLOCK)


def test_eviction_under_pressure_keeps_outputs_right_and_leaks_nothing() -> None:
    prompts = random_prompts(6, ARGS.vocab_size, [30, 22, 35], seed=8)
    prompts += [[*p, 1, 2, 3] for p in prompts[:3]]
    ref = [c.token_ids for c in engine(7, caching=False).generate(prompts, {"max_tokens": 10})]
    eng = engine(7, caching=True, num_blocks=18)
    got = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 10})]
    again = [c.token_ids for c in eng.generate(prompts[::-1], {"max_tokens": 10})][::-1]
    assert got == ref and again == ref
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and 0 < blocks.num_cached <= blocks.num_blocks
    assert eng.scheduler.prefix_hit_tokens > 0


def test_forgetting_the_cache_means_no_hits() -> None:
    eng = engine(16, caching=True)
    prompt = random_prompts(1, ARGS.vocab_size, [33], seed=2)[0]
    eng.generate([prompt], {"max_tokens": 3})
    assert eng.scheduler.forget_cached() > 0
    eng.generate([prompt], {"max_tokens": 3})
    assert eng.scheduler.prefix_hit_tokens == 0


def test_caching_is_off_for_the_sampled_lookahead_ablation() -> None:
    on = MTPServeConfig.model_validate({})
    off = MTPServeConfig.model_validate({"speculative": {"lookahead_source": "sampled"}})
    flag_off = MTPServeConfig.model_validate({"scheduler": {"prefix_caching": False}})
    assert on.prefix_caching and not off.prefix_caching and not flag_off.prefix_caching
