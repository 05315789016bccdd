"""When requests that arrive while steps are launched ahead join the batch.

A waiting request joins in a step launched ahead (`Scheduler.plan_ahead`, its whole prompt in a prefill replay
beside the decode rows), or, when it cannot, through `Scheduler.schedule` once the launched steps are read, in a step
run in turn that costs the batch about a step's overlap. Either way each join costs a step a prefill replay; joining
arrivals together spreads that cost: they wait while few have arrived, for at most `scheduler.admit_wait_ms`
counted from their arrival or from the end of the last step that admitted requests, whichever is later (so that
a slow joining step does not make every later arrival overdue at once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpserve.cluster.engine.request import Request

BATCH_SHARE = 8  # arrivals join at once when they are this fraction (1/8) of the decoding batch


@dataclass
class AdmitWindow:
    """The rule, the last step that admitted requests (`admitted_in`) and when it was applied (`joined_at`,
    monotonic seconds)."""

    wait_ms: float
    joined_at: float = 0.0
    admitted_in: int = -1

    def admit_now(self, waiting: Sequence[Request], decoding: int, *, free_slots: int, now: float) -> bool:
        """Whether the `waiting` requests should join the `decoding` ones at the next step: there are any, a slot
        is free for them, and they are an eighth of the batch or the oldest has waited `wait_ms`.

        Example, 256 decoding, wait_ms 6, the last admitting step applied 10 ms ago: 5 waiting requests, the
        oldest 2 ms old, keep waiting; 32 waiting join; so does 1 that arrived 6 ms ago. Had the last admitting
        step been applied 3 ms ago, that one would wait 3 ms more. With 4 decoding, 1 waiting joins at once."""
        if not waiting or free_slots <= 0:
            return False
        if len(waiting) * BATCH_SHARE >= decoding:
            return True
        return (now - max(waiting[0].arrival_time, self.joined_at)) * 1000 >= self.wait_ms
