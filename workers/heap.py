"""The serving processes' start-up heap kept out of the garbage collector's full passes (`freeze_startup_heap`).

A full collection walks every tracked object. After start-up an engine process holds hundreds of thousands (the
model's modules, the tokenizer, captured graphs, the scheduler), and a full pass over them stalls its step loop
for tens of milliseconds (about 150 ms on a 2-core CI machine; `bench/probes/gc_pauses.py`). Objects frozen after
start-up sit in a permanent generation that collections skip, so later passes walk only what serving allocates.
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen. Unfrozen again at exit, so
    that the interpreter's last collection still sees them."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    atexit.register(gc.unfreeze)
    log.info("%s: %d start-up objects frozen out of the garbage collector's passes", what, frozen)
    return frozen
