"""What the server's processes share across their pipes, without the engine's imports: the message tags between
the engine and the front ends, step outputs packed for the pipe, and how a child process of the server is started
and set up. A front-end process imports this and never the model stack."""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any

from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.service.request_book import EngineFailure
from mtpserve.speculative.stats import SpecStats
from mtpserve.speculative.token_logprobs import TokenLogprobs

# front ends -> engine
ADD, ABORT, STOP, BATCH = "add", "abort", "stop", "batch"  # a BATCH holds several of the others, in order
# engine -> front ends
READY, ERROR, ADDED, OUT, FAIL, STOPPED, HEALTH = "ready", "error", "added", "out", "fail", "stopped", "health"
ABORTED = "aborted"

PARENT_CHECK_S = 1.0
ENGINE_ENTRY = "mtpserve.cluster.service.engine_child:run_engine_process"  # the engine process's function

PackedLogprobs = tuple[list[float], list[list[int]], list[list[float]]]
PackedOutput = tuple[
    str,
    list[int],
    bool,
    str | None,
    int,
    int,
    tuple[int, int, int, list[int], list[int]],
    tuple[float, ...] | None,
    PackedLogprobs | None,
]


def pack_outputs(outputs: list[RequestOutput]) -> list[PackedOutput]:
    """Outputs as plain tuples (pickled in half the time of the dataclasses)."""
    return [
        (
            o.request_id,
            o.new_token_ids,
            o.finished,
            o.finish_reason,
            o.num_prompt_tokens,
            o.num_output_tokens,
            (
                o.stats.drafted,
                o.stats.accepted,
                o.stats.verify_steps,
                o.stats.accepted_per_position,
                o.stats.drafted_per_position,
            ),
            o.timings,
            None
            if o.logprobs is None
            else (o.logprobs.token_logprobs, o.logprobs.top_token_ids, o.logprobs.top_logprobs),
        )
        for o in outputs
    ]


def unpack_outputs(packed: list[PackedOutput]) -> list[RequestOutput]:
    """The outputs `pack_outputs` packed."""
    return [
        RequestOutput(
            rid,
            ids,
            finished,
            reason,
            num_prompt_tokens=n_prompt,
            num_output_tokens=n_out,
            stats=SpecStats(*stats),  # type: ignore[arg-type]
            timings=timings,  # type: ignore[arg-type]
            logprobs=None if lp is None else TokenLogprobs(*lp),
        )
        for rid, ids, finished, reason, n_prompt, n_out, stats, timings, lp in packed
    ]


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else an EngineFailure carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineFailure(f"{type(exc).__name__}: {exc}")


def serve_as_child(parent_pid: int, log_level: int, tag: str) -> None:
    """Set up a child of the server: signals to the whole process group (Ctrl-C, a supervisor's SIGTERM) are the
    parent's to handle, which stops this process in order; log lines carry `tag`; the process ends by itself
    once the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s[{tag}]: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="mtpserve-parent-watch", daemon=True).start()


def kill_at_exit(proc: BaseProcess) -> None:
    """At this interpreter's exit, kill a child still running (it ignores SIGTERM, which multiprocessing's own exit
    hook sends before it waits on the child without a limit)."""
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process once its parent is gone (killed while the model loads, say); a closed pipe ends it later."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def spawn_child(entry: str, args: tuple[Any, ...], name: str) -> BaseProcess:
    """Start `entry` ("module:function") with `args` in a fresh interpreter (spawn: safe for CUDA, and no copy of
    this one's threads), killed at this interpreter's exit if it still runs. Only the child imports the entry's
    module, so starting an engine does not load the model stack here."""
    proc = mp.get_context("spawn").Process(target=run_entry, args=(entry, *args), name=name, daemon=True)
    proc.start()
    atexit.register(kill_at_exit, proc)
    return proc


def run_entry(entry: str, *args: Any) -> None:
    """Call the function `entry` ("module:function") names with `args` (a spawned child's first call)."""
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(*args)
