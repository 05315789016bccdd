"""Routing over engine replicas by cached prefix and load (`cluster/service/replica_router.py`): multi-turn chats
keep landing where their prefix is cached, load overrules a busy holder, dead replicas are forgotten."""

from __future__ import annotations

import random

import pytest

from mtpserve.cluster.engine.prefix_keys import extend_keys, num_keyable_blocks
from mtpserve.cluster.service.replica_router import PrefixRouter

BLOCK = 16


def conversations(n: int, turns: int, seed: int) -> list[list[list[int]]]:
    """n chats of `turns` prompts each; every prompt repeats the one before, the answer to it and a new message."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(24)]  # a system prompt every chat shares
    chats = []
    for _ in range(n):
        prompt = system + [rng.randrange(1000) for _ in range(rng.randrange(10, 60))]
        chat = [prompt]
        for _ in range(turns - 1):
            answer = [rng.randrange(1000) for _ in range(rng.randrange(20, 80))]
            prompt = prompt + answer + [rng.randrange(1000) for _ in range(rng.randrange(5, 40))]
            chat.append(prompt)
        chats.append(chat)
    return chats


def interleaved(chats: list[list[list[int]]]) -> list[list[int]]:
    """Every chat's first turn, then every chat's second turn, ...: many chats in flight at once."""
    return [chat[t] for t in range(len(chats[0])) for chat in chats]


def hit_tokens(order: list[list[int]], pick: list[int], replicas: int) -> int:
    """Prompt tokens the replicas' caches serve when each prompt goes to pick[i] (each cache keeps every block
    it ever computed, found by the same keys the engine uses)."""
    caches: list[set[bytes]] = [set() for _ in range(replicas)]
    hits = 0
    for prompt, r in zip(order, pick, strict=True):
        keys = extend_keys([], prompt, BLOCK, num_keyable_blocks(len(prompt), BLOCK))
        for key in keys:
            if key not in caches[r]:
                break
            hits += BLOCK
        caches[r].update(keys)
    return hits


def test_later_turns_land_where_their_prefix_is_cached() -> None:
    """41 chats of 4 turns over 2 replicas: routed by prefix the caches serve >= 90% of the tokens one replica
    alone would serve, round-robin about half of it, and the chats spread over both replicas."""
    order = interleaved(conversations(41, 4, seed=1))  # odd: round-robin moves a chat at every turn
    router = PrefixRouter(2, BLOCK, seed=0)
    routed: list[int] = []
    for prompt in order:
        routed.append(router.route(prompt).replica)
        in_flight = routed[-16:]  # each request runs while the next 15 arrive
        for r in range(2):
            router.report_load(r, in_flight.count(r), 0)
    one = hit_tokens(order, [0] * len(order), 1)
    by_prefix = hit_tokens(order, routed, 2)
    round_robin = hit_tokens(order, [i % 2 for i in range(len(order))], 2)
    assert by_prefix >= 0.9 * one, (by_prefix, one)
    assert round_robin <= 0.7 * one, (round_robin, one)
    first_turns = routed[:41]
    assert 10 <= sum(first_turns) <= 31, first_turns


def test_routers_of_several_front_ends_that_share_their_routes_keep_chats_on_their_cache() -> None:
    """Three front ends, each with its own router over the same 2 replicas, each prompt taken by a front end at
    random: told one another's routes, they serve >= 90% of one replica's cache hits; kept apart, clearly fewer."""
    order = interleaved(conversations(41, 4, seed=2))
    hits = {}
    for sharing in (True, False):
        routers = [PrefixRouter(2, BLOCK, seed=i) for i in range(3)]
        rng = random.Random(5)
        routed: list[int] = []
        for prompt in order:
            taker = rng.randrange(3)
            choice = routers[taker].route(prompt)
            routed.append(choice.replica)
            assert choice.keys == extend_keys([], prompt, BLOCK, num_keyable_blocks(len(prompt), BLOCK))
            in_flight = routed[-16:]
            for router in routers:
                if sharing and router is not routers[taker]:
                    router.learn(choice.keys, choice.replica)
                for r in range(2):
                    router.report_load(r, in_flight.count(r), 0)
        hits[sharing] = hit_tokens(order, routed, 2)
    one = hit_tokens(order, [0] * len(order), 1)
    print(f"\nhit tokens: one replica {one}, routers sharing {hits[True]}, apart {hits[False]}")
    assert hits[True] >= 0.9 * one, (hits, one)
    assert hits[False] <= 0.8 * one, (hits, one)


def test_a_route_learned_for_a_replica_out_of_service_is_ignored() -> None:
    """Keys reported for a removed replica index nothing: the prompt goes by load, not to the dead replica."""
    router = PrefixRouter(2, BLOCK, seed=0)
    prompt = list(range(64))
    keys = extend_keys([], prompt, BLOCK, num_keyable_blocks(len(prompt), BLOCK))
    router.remove(1)
    router.learn(keys, 1)
    router.add(1)
    router.report_load(0, 0, 0)
    router.report_load(1, 5, 0)
    assert router.route(prompt).replica == 0


def test_load_overrules_a_busy_holder_and_ties_go_by_prefix() -> None:
    router = PrefixRouter(2, BLOCK, balance=4)
    prompt = list(range(100))
    first = router.route(prompt)
    assert first.reason == "load" and first.matched_blocks == 0
    holder, other = first.replica, 1 - first.replica
    router.report_load(holder, 3, 0)
    router.report_load(other, 0, 0)
    again = router.route([*prompt, 7, 8, 9])
    assert (again.replica, again.reason, again.matched_blocks) == (holder, "prefix", 6)
    router.report_load(holder, 20, 5)
    router.report_load(other, 1, 0)
    busy = router.route([*prompt, 1, 2])
    assert busy.replica == other and busy.reason == "load"


def test_a_removed_replica_gets_nothing_and_its_prefixes_move() -> None:
    router = PrefixRouter(3, BLOCK)
    prompts = [[i] * 50 + list(range(40)) for i in range(30)]
    placed = {tuple(p): router.route(p).replica for p in prompts}
    gone = max(set(placed.values()), key=list(placed.values()).count)
    router.remove(gone)
    for p in prompts:
        choice = router.route(p)
        assert choice.replica != gone
        if placed[tuple(p)] == gone:
            assert choice.matched_blocks == 0  # its cache went with it
    router.remove(next(iter(router.live)))
    only = router.route(prompts[0])
    assert only.reason == "only" and only.replica in router.live
    router.add(gone)
    assert gone in router.live and router.loads[gone] == 0
    router.remove(0), router.remove(1), router.remove(2)
    with pytest.raises(RuntimeError, match="no replica"):
        router.route(prompts[0])


def test_the_index_forgets_the_least_recently_used_keys() -> None:
    router = PrefixRouter(2, BLOCK, capacity=10)
    old = list(range(1000, 1000 + 5 * BLOCK + 1))  # 5 keys
    router.route(old)
    for i in range(3):
        router.route([i] * (3 * BLOCK + 1))  # 3 keys each: 14 in all, 10 kept
    assert len(router._index) == 10
    assert router.route(old).matched_blocks == 0  # its keys were the oldest


@pytest.mark.parametrize(
    "kwargs", [{"replicas": 0}, {"block_size": 0}, {"capacity": 0}, {"balance": -1}, {"threshold": 1.5}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    settings = {"replicas": 2, "block_size": 16, **kwargs}
    with pytest.raises(ValueError, match="PrefixRouter needs"):
        PrefixRouter(int(settings.pop("replicas")), int(settings.pop("block_size")), **settings)  # type: ignore[arg-type]


def test_a_prefix_every_replica_holds_neither_pulls_nor_breaks_a_chats_run() -> None:
    """A system prompt both replicas have cached gives a new chat no reason to pick one (it goes by load), and a
    chat's later turn still finds its own run on its replica, wherever the shared blocks were sent last."""
    router = PrefixRouter(2, BLOCK, balance=0)
    system = list(range(500, 500 + 2 * BLOCK))
    chat_a = [*system, *range(20)]
    a = router.route(chat_a).replica
    router.report_load(a, 1, 0)
    router.report_load(1 - a, 0, 0)
    b = router.route([*system, *range(100, 120)])
    assert b.replica == 1 - a and b.reason == "load" and b.matched_blocks == 0  # the holder was busier
    router.report_load(a, 0, 0)
    router.report_load(1 - a, 0, 0)
    later = router.route([*chat_a, *range(40, 80)])
    assert (later.replica, later.reason) == (a, "prefix") and later.matched_blocks == 3
    new = router.route([*system, *range(200, 220)])
    assert new.reason == "load" and new.matched_blocks == 1  # a key holds the token after its block: 1 shared
