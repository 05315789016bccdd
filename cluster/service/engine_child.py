"""The engine's side of the pipe between the engine and the front ends when they run in separate processes
(engine_process.py is the other side). Adds and aborts come in between steps; every step's outputs and the
scheduler's state go out, a step's tokens before its draft runs. The engine has its process's interpreter to
itself, so the front ends' work on every token never waits on it for the GIL, nor it on them.

`run_engine_process` is the child `mtpserve serve` starts: it builds the engine from the config and serves the
pipe. With Ray the scheduler actor keeps the engine and serves the pipe from a thread (front_end_process.py)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.scheduler import RequestOutput
from mtpserve.cluster.service.model_info import model_info
from mtpserve.cluster.service.request_book import EngineFailure, engine_load, step_error
from mtpserve.speculative.stats import SpecStats
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)

# front ends -> engine
ADD, ABORT, STOP, BATCH = "add", "abort", "stop", "batch"  # a BATCH holds several of the others, in order
# engine -> front ends
READY, ERROR, ADDED, OUT, FAIL, STOPPED, HEALTH = "ready", "error", "added", "out", "fail", "stopped", "health"
ABORTED = "aborted"

PARENT_CHECK_S = 1.0

PackedOutput = tuple[str, list[int], bool, str | None, int, int, tuple[int, int, int, list[int], list[int]]]


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
        )
        for o in outputs
    ]


def unpack_outputs(packed: list[PackedOutput]) -> list[RequestOutput]:
    """The outputs `pack_outputs` packed."""
    return [
        RequestOutput(rid, ids, finished, reason, n_prompt, n_out, SpecStats(*stats))
        for rid, ids, finished, reason, n_prompt, n_out, stats in packed
    ]


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else an EngineFailure carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineFailure(f"{type(exc).__name__}: {exc}")


def run_engine_process(cfg: MTPServeConfig, conn: Connection, parent_pid: int, log_level: int = logging.INFO) -> None:
    """Entry point of the engine process: send READY (model info, tokenizer, scheduler state) or ERROR, then serve
    until STOP or until the parent is gone."""
    serve_as_child(parent_pid, log_level, "engine")
    try:
        engine = LLMEngine.from_config(cfg)
    except BaseException as exc:
        if not isinstance(exc, MTPServeError):
            log.exception("the engine could not be built")
        conn.send((ERROR, portable(exc)))
        return
    try:
        send_ready(engine, conn)
        PipedEngine(engine, conn).run()
    finally:
        engine.shutdown()


def send_ready(engine: LLMEngine, conn: Connection) -> None:
    """Tell the peer what it serves: READY with the model info, the tokenizer and the scheduler state."""
    conn.send((READY, model_info(engine).SerializeToString(), engine.tokenizer, engine_load(engine)))


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


class PipedEngine:
    """Drives an engine for the peer at the other end of `conn` (the server's process, or a front-end process):
    applies its commands between steps and sends every step's results, and worker outages as HEALTH."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.live: set[str] = set()  # requests added and not yet ended
        self.peer_gone = False
        self._send_lock = threading.Lock()  # health listeners may call from the workers' restart thread
        engine.on_tokens = self._send_outputs
        engine.health_listeners.append(self._send_health)

    def run(self) -> None:
        """Serve until STOP or until the peer's end of the pipe closes."""
        try:
            while not self.peer_gone and self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
            for rid in list(self.live):
                self.engine.abort(rid)
            self._send((STOPPED, engine_load(self.engine)))
        finally:
            self.engine.health_listeners.remove(self._send_health)
            if self.engine.on_tokens == self._send_outputs:
                self.engine.on_tokens = None  # another peer may drive the engine next

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when `block`); False on STOP or a closed pipe."""
        try:
            if block:
                self.conn.poll(None)
            while self.conn.poll():
                msg = self.conn.recv()
                for cmd in msg[1] if msg[0] == BATCH else [msg]:
                    if cmd[0] == STOP:
                        return False
                    self._apply(cmd)
        except (EOFError, OSError):
            self.peer_gone = True
            return False
        return True

    def _apply(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == ABORT:
            self.live.discard(msg[1])
            self.engine.abort(msg[1])
            self._send((ABORTED, msg[1], engine_load(self.engine)))  # the freed blocks show before the next step
            return
        _, seq, rid, ids, params = msg
        try:
            self.engine.add_request(ids, params, rid)
        except Exception as exc:
            self._send((ADDED, seq, portable(exc)))
            return
        self.live.add(rid)
        self._send((ADDED, seq, None))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            err = step_error(exc)
            log.exception("engine step failed; failing %d in-flight requests", len(self.live))
            for rid in list(self.live):
                try:
                    self.engine.abort(rid)
                except Exception:  # the engine may be broken; keep ending the rest
                    log.exception("abort of %s after an engine failure raised", rid)
            self.live.clear()
            self.engine.scheduler.forget_cached()  # the KV those keys point at may be gone
            self._send((FAIL, portable(err), engine_load(self.engine)))
            return
        self._send_outputs(outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if o.finished:
                self.live.discard(o.request_id)
        self._send((OUT, pack_outputs(outputs), engine_load(self.engine)))

    def _send_health(self, ok: bool) -> None:
        self._send((HEALTH, ok))

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except OSError:
            self.peer_gone = True
