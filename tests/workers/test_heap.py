"""The serving processes' start-up heap, frozen out of the garbage collector's passes."""

from __future__ import annotations

import gc

from mtpserve.workers.heap import freeze_startup_heap


class Node:
    """A tracked object in a reference cycle."""

    def __init__(self) -> None:
        self.me = self


def test_objects_alive_at_start_up_are_frozen_and_later_ones_are_not() -> None:
    """What lives when the heap is frozen leaves the collector's view; what comes later stays in it."""
    before = Node()
    try:
        frozen = freeze_startup_heap("test")
        after = Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert frozen == gc.get_freeze_count() and frozen > 1000
        assert id(before) not in tracked and id(after) in tracked
    finally:
        gc.unfreeze()
    assert id(before) in {id(o) for o in gc.get_objects()}
