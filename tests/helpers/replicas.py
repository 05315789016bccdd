"""Multi-turn chats against a FrontEndPool of replicas, and what its engines report: the prefix-cache tokens they
served, whether a given replica takes requests, and a growth and shrink of its engines under streams."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.front_end_pool import FrontEndPool
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import wait_for


def replica_config(
    model: Path, head: Path, replicas: int, routing: str = "prefix", frontends: int = 1
) -> MTPServeConfig:
    """A CPU config of the tiny model (K=2 chain) with `replicas` engines routed by `routing` behind `frontends`
    front ends, every port 0."""
    server = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "replicas": replicas, "routing": routing}
    return MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "device": "cpu"},
            "speculative": {"draft": str(head), "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 256, "max_num_requests": 8, "block_size": 16},
            "server": {**server, "frontends": frontends},
        }
    )


def pool_chats(pool: FrontEndPool, vocab: int, chats: int = 7, turns: int = 4) -> tuple[list[list[int]], int]:
    """Every chat's answers, turn after turn (each turn's prompt: the last prompt, its answer and 24 new tokens),
    each request on a new connection (so the kernel spreads them over the front ends), and the prompt tokens the
    engines served from their prefix caches. Token ids are drawn below `vocab`."""
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(40)] for _ in range(chats)]
    answers: list[list[int]] = []
    for _ in range(turns):
        for c in range(chats):
            client = MTPServeClient(pool.address)
            try:
                out = client.generate(token_ids=prompts[c], max_tokens=8, ignore_eos=True)
            finally:
                client.close()
            answers.append(out["token_ids"])
            prompts[c] = [*prompts[c], *out["token_ids"], *(rng.randrange(vocab) for _ in range(24))]
    return answers, wait_for(lambda: settled_hits(pool), 10)


def settled_hits(pool: FrontEndPool) -> int:
    """The engines' prefix-cache hit tokens once their reported states stop changing (0 until then)."""
    before = pool.loads
    time.sleep(0.5)
    return sum(x.prefix_hit_tokens for x in before) if pool.loads == before else 0


def serves_again(pool: FrontEndPool, replica: int, timeout: float = 60.0) -> bool:
    """True once requests on new connections (any front end) reach `replica`: its reported steps grow."""
    steps = pool.loads[replica].steps

    def reached() -> bool:
        with MTPServeClient(pool.address) as client:
            assert len(client.generate(token_ids=[17, 18, 19, 20], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
        return pool.loads[replica].steps > steps

    return bool(wait_for(reached, timeout))


def grows_and_shrinks(pool: FrontEndPool) -> None:
    """Drive `pool` (one engine of 2 requests, growing to 2 engines once 2 requests wait per engine) through a
    growth and a shrink: 8 clients send requests of 120 tokens one after another (2 run, 6 wait) until it has
    added an engine, then 6 clients send 3 requests of 40 tokens each (those after the front ends connected to
    the new engine go there too), and once idle it stops the added one. Asserts that no stream was cut and that a
    request after the shrink is served."""
    lengths: dict[int, list[int]] = {120: [], 40: []}
    errors: list[BaseException] = []
    grown = threading.Event()

    def stream(i: int, tokens: int, requests: int) -> None:
        try:
            for _ in range(requests):
                if tokens == 120 and grown.is_set():
                    return
                with MTPServeClient(pool.address) as client:
                    out = client.generate(token_ids=[40 + i, 41, 42], max_tokens=tokens, ignore_eos=True)
                lengths[tokens].append(len(out["token_ids"]))
        except BaseException as exc:
            errors.append(exc)

    assert pool.engines_up == 1
    first = [threading.Thread(target=stream, args=(i, 120, 1000)) for i in range(8)]
    for t in first:
        t.start()
    try:
        wait_for(lambda: pool.engines_up == 2, 180)
    except TimeoutError:
        raise AssertionError(f"no growth: loads {pool.loads}, errors {errors}") from None
    finally:
        grown.set()
    second = [threading.Thread(target=stream, args=(10 + i, 40, 3)) for i in range(6)]
    for t in second:
        t.start()
    for t in first + second:
        t.join(300)
    assert errors == [] and lengths[40] == [40] * 18, (errors, lengths)
    assert lengths[120] and set(lengths[120]) == {120}, lengths[120]
    assert pool.loads[1].steps > 0, pool.loads  # the added engine took some of the requests
    assert wait_for(lambda: pool.engines_up == 1, 120), pool.scaled  # idle again: back to one engine
    assert pool.scaled == [("up", 1), ("down", 1)]
    with MTPServeClient(pool.address) as client:
        assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
