"""When a replica set grows or shrinks (`serve --max-replicas`): `Scaler` reads the active replicas' loads and
asks for one more replica while requests wait at every replica, one fewer while nothing waits and the running
requests would fit the others at half their capacity, each only after the condition has held `hold_s` seconds.

Example, min 1, max 2, up_waiting 4, capacity 8, hold 10 s: one replica with 8 running and 5 waiting asks for a
second after 10 s of that; two replicas with 3 and 0 running and none waiting ask to shrink after 10 s (3 <= 4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Action = Literal["up", "down"]


@dataclass
class Scaler:
    """The scaling rule of a replica set (see the module docstring)."""

    min_replicas: int
    max_replicas: int
    up_waiting: int  # waiting requests per active replica that ask for one more
    capacity: int  # requests one replica runs at once (scheduler.max_num_requests)
    hold_s: float  # how long a condition holds before it acts
    _pending: tuple[Action, float] | None = field(default=None, repr=False)

    def want(self, loads: Sequence[tuple[int, int]]) -> Action | None:
        """What the active replicas' (running, waiting) loads ask for now, before any holding time."""
        n = len(loads)
        running, waiting = sum(r for r, _ in loads), sum(w for _, w in loads)
        if n < self.max_replicas and waiting >= self.up_waiting * max(n, 1):
            return "up"
        if n > self.min_replicas and waiting == 0 and running <= self.capacity * (n - 1) // 2:
            return "down"
        return None

    def decide(self, loads: Sequence[tuple[int, int]], now: float) -> Action | None:
        """The action to take now: `want`, once it has held `hold_s` seconds without a break (then it starts over)."""
        want = self.want(loads)
        if want is None:
            self._pending = None
            return None
        if self._pending is None or self._pending[0] != want:
            self._pending = (want, now)
        if now - self._pending[1] < self.hold_s:
            return None
        self._pending = None
        return want
