"""Multi-turn chats against a FrontEndPool of replicas, and what its engines report: the prefix-cache tokens they
served, and whether a given replica takes requests."""

from __future__ import annotations

import random
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
