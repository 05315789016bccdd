"""When requests that arrive while steps are launched ahead join the batch.

A waiting request joins through `Scheduler.schedule`, so the launched steps must be read first and its prompt
chunk runs in a step of its own kind: each join costs the batch about a step's worth of launch overlap. Joining
arrivals together spreads that cost: they wait while few have arrived, for at most `scheduler.admit_wait_ms`."""

from __future__ import annotations

from collections.abc import Sequence

from mtpserve.cluster.engine.request import Request

BATCH_SHARE = 8  # arrivals join at once when they are this fraction (1/8) of the decoding batch


def admit_now(waiting: Sequence[Request], decoding: int, *, free_slots: int, wait_ms: float, now: float) -> bool:
    """Whether the `waiting` requests should join the `decoding` ones at the next step: there are any, a slot
    is free for them, and they are an eighth of the batch or the oldest has waited `wait_ms`.

    Example, 256 decoding, wait_ms 6: 5 waiting requests, the oldest 2 ms old, keep waiting; 32 waiting join;
    so does 1 that has waited 6 ms. With 4 decoding, 1 waiting request joins at once."""
    if not waiting or free_slots <= 0:
        return False
    return len(waiting) * BATCH_SHARE >= decoding or (now - waiting[0].arrival_time) * 1000 >= wait_ms
