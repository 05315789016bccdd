"""Which engine replica serves a request: the one most likely to hold its prompt's prefix in its KV cache,
unless that one is much busier than the others.

The router keeps an index from prefix-cache block keys (`cluster/engine/prefix_keys.py`, the keys the replicas'
own caches use) to the replicas it sent them to, least recently used first out. A request's keys are looked up
from its first block on, for each replica the run of leading keys it holds. The replica with the longest run wins
if its run exceeds the shortest any live replica holds (a system prompt every replica has seen saves nothing by
choosing) by at least `threshold` of the prompt's blocks, and its load (running + waiting requests) exceeds the
least loaded replica's by no more than `balance`. Otherwise the request goes to the less loaded of two replicas
drawn at random (power of two choices): a short match would pull every chat to one replica, and a busy holder
would make the request wait longer than its prefix saves. Afterwards its keys point at the replica chosen too, as
that replica will cache those blocks. Several front ends, each with its own router over the same replicas, tell
one another where they sent which keys (`learn`), so a chat's later turn finds its prefix whichever front end
takes it.

Example, two replicas, block size 16: a chat's first turn (40 prompt tokens: 2 keyable blocks) finds nothing
and goes to replica 1 by load; its second turn repeats those 40 tokens and adds 30 (4 blocks), so its first 2
keys point at replica 1 (half its blocks, above the 0.25 threshold) and it goes there too, whose cache then
serves 32 of its tokens. On 41 four-turn chats sharing a system prompt (tests/service/test_replica_router.py) two
replicas routed so serve 99% of the prompt tokens from cache that one replica would, round-robin 53%.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from mtpserve.cluster.engine.prefix_keys import extend_keys, num_keyable_blocks


@dataclass
class RouteChoice:
    """A routing decision: the replica, how many of the prompt's leading blocks the index placed there, and why."""

    replica: int
    matched_blocks: int
    reason: str  # "prefix", "load" (prefix overruled by load, or none found) or "only" (one replica live)
    keys: list[bytes] = field(default_factory=list)  # the prompt's block keys, now indexed at `replica`


class PrefixRouter:
    """Routes requests over `replicas` engines by cached prefix and load (see the module docstring)."""

    def __init__(
        self,
        replicas: int,
        block_size: int,
        *,
        capacity: int = 200_000,
        balance: int = 8,
        threshold: float = 0.25,
        seed: int = 0,
    ) -> None:
        if replicas < 1 or block_size < 1 or capacity < 1 or balance < 0 or not 0.0 <= threshold <= 1.0:
            raise ValueError(
                "PrefixRouter needs replicas >= 1, block_size >= 1, capacity >= 1, balance >= 0 and threshold in [0, 1]"
            )
        self.block_size, self.capacity, self.balance, self.threshold = block_size, capacity, balance, threshold
        self.loads = [0] * replicas  # running + waiting requests, as each replica last reported
        self.live = set(range(replicas))
        self._index: OrderedDict[bytes, set[int]] = OrderedDict()  # key -> the replicas it was sent to
        self._rng = random.Random(seed)

    def route(self, token_ids: Sequence[int]) -> RouteChoice:
        """The replica for a prompt; indexes its keys there."""
        if not self.live:
            raise RuntimeError("no replica is live")
        keys = extend_keys([], token_ids, self.block_size, num_keyable_blocks(len(token_ids), self.block_size))
        runs = self._runs(keys)
        least = min(self.live, key=lambda r: (self.loads[r], r))
        holder = max(self.live, key=lambda r: (runs[r], -self.loads[r], -r))
        gain = runs[holder] - min(runs.values())
        if len(self.live) == 1:
            choice = RouteChoice(least, runs[least], "only")
        elif gain > 0 and gain >= self.threshold * len(keys) and self.loads[holder] - self.loads[least] <= self.balance:
            choice = RouteChoice(holder, runs[holder], "prefix")
        else:
            a, b = self._rng.sample(sorted(self.live), 2)
            pick = b if self.loads[b] < self.loads[a] else a  # ties: the first drawn, at random
            choice = RouteChoice(pick, runs[pick], "load")
        choice.keys = keys
        self.learn(keys, choice.replica)
        self.loads[choice.replica] += 1  # until the replica reports again
        return choice

    def learn(self, keys: Sequence[bytes], replica: int) -> None:
        """Index `keys` at `replica`: a prompt routed there, by this router or by another front end's."""
        if replica not in self.live:
            return
        for key in keys:
            self._index.setdefault(key, set()).add(replica)
            self._index.move_to_end(key)
        while len(self._index) > self.capacity:
            self._index.popitem(last=False)

    def _runs(self, keys: list[bytes]) -> dict[int, int]:
        """For each live replica, how many of the leading keys it holds without a gap."""
        runs = dict.fromkeys(self.live, 0)
        holding = set(self.live)
        for key in keys:
            holding &= self._index.get(key, set())
            if not holding:
                break
            for r in holding:
                runs[r] += 1
            self._index.move_to_end(key)
        return runs

    def report_load(self, replica: int, running: int, waiting: int) -> None:
        """A replica's load as it reported it."""
        self.loads[replica] = running + waiting

    def remove(self, replica: int) -> None:
        """A replica that died or is draining: no new requests, and its keys are forgotten."""
        self.live.discard(replica)
        for key in [k for k, holders in self._index.items() if replica in holders]:
            self._index[key].discard(replica)
            if not self._index[key]:
                del self._index[key]

    def add(self, replica: int) -> None:
        """A replica (back) in service, with an empty cache."""
        while replica >= len(self.loads):
            self.loads.append(0)
        self.loads[replica] = 0
        self.live.add(replica)
