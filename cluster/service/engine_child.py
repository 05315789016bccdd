"""The engine's side of the pipe between the engine and the front ends when they run in separate processes
(engine_process.py is the other side). Adds and aborts come in between steps; every step's outputs and the
scheduler's state go out, a step's tokens before its draft runs. The engine has its process's interpreter to
itself, so the front ends' work on every token never waits on it for the GIL, nor it on them.

`run_engine_process` is the child `mtpserve serve` starts: it builds the engine from the config and serves the
pipe. With Ray the scheduler actor keeps the engine and serves the pipe from a thread (front_end_process.py)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import selectors
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.request_output import RequestOutput
from mtpserve.cluster.service.child_link import (
    ABORT,
    ABORTED,
    ADDED,
    BATCH,
    ERROR,
    FAIL,
    HEALTH,
    OUT,
    READY,
    STOP,
    STOPPED,
    pack_outputs,
    portable,
    serve_as_child,
)
from mtpserve.cluster.service.model_info import model_info
from mtpserve.cluster.service.peer_sender import PeerSender
from mtpserve.cluster.service.pool_engines import unlink_socket
from mtpserve.cluster.service.request_book import engine_load, step_error
from mtpserve.modeling.loader import resolve_device
from mtpserve.workers.builders import set_cpu_threads
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.heap import freeze_startup_heap

log = logging.getLogger(__name__)

STATE_EVERY_S = 0.1  # a peer without outputs in a step still hears the engine state this often


def run_engine_process(
    cfg: MTPServeConfig,
    conn: Connection,
    parent_pid: int,
    log_level: int = logging.INFO,
    listen: tuple[str, bytes] | None = None,
) -> None:
    """Entry point of the engine process: send READY (model info, tokenizer, scheduler state) or ERROR, then serve
    until STOP or until the parent is gone. With `listen` (a Unix socket path and its key), the parent only
    controls the engine, and front ends connect on that socket to serve it."""
    serve_as_child(parent_pid, log_level, "engine")
    try:
        threads = set_cpu_threads(cfg)
        if threads is not None:
            log.info("the model runs on the CPU with %d torch threads (model.cpu_threads)", threads)
        engine = LLMEngine.from_config(cfg)
    except BaseException as exc:
        if not isinstance(exc, MTPServeError):
            log.exception("the engine could not be built")
        conn.send((ERROR, portable(exc)))
        return
    try:
        warm_up_for_serving(engine)
        freeze_startup_heap("engine process")
        listener = None if listen is None else Listener(listen[0], family="AF_UNIX", authkey=listen[1])
        send_ready(engine, conn)
        PipedEngine(engine, conn, streams=listener is None, listener=listener).run()
    finally:
        engine.shutdown()


def warm_up_for_serving(engine: LLMEngine) -> None:
    """`engine.warm_up()` when it runs on CUDA and `model.warm_up` is on (kernels compile there on first use)."""
    if not engine.cfg.model.warm_up or resolve_device(engine.cfg.model.device) != "cuda":
        return
    t0 = time.monotonic()
    engine.warm_up()
    log.info("warmed up in %.1f s", time.monotonic() - t0)


def send_ready(engine: LLMEngine, conn: Connection) -> None:
    """Tell the peer what it serves: READY with the model info, the tokenizer and the scheduler state."""
    conn.send((READY, model_info(engine).SerializeToString(), engine.tokenizer, engine_load(engine)))


@dataclass(eq=False)
class Peer:
    """One process at the other end of a pipe to the engine. A `streams` peer (a front end) sends adds and aborts
    and hears its requests' outputs; any peer hears health and failures. When the `primary` peer stops (or its
    pipe closes), the engine stops; any other peer that leaves takes only its own requests with it."""

    conn: Connection
    streams: bool = True
    primary: bool = True
    live: set[str] = field(default_factory=set)  # its requests added and not yet ended
    heard_at: float = 0.0  # when it was last sent the engine state
    stale: bool = False  # the engine state changed since


class PipedEngine:
    """Drives an engine for the peers at the other end of pipes: the server's process, or front-end processes
    (one or several). Applies their commands between steps and sends every step's results, each request's to the
    peer that added it, and worker outages as HEALTH to all. With `listener`, front ends may connect at any time
    (front_end_pool.py): each gets READY, then serves beside the others."""

    def __init__(
        self, engine: LLMEngine, conn: Connection, streams: bool = True, listener: Listener | None = None
    ) -> None:
        self.engine = engine
        self.peers = [Peer(conn, streams=streams)]
        self.owner: dict[str, Peer] = {}
        self.peer_gone = False
        self._joining_lock = threading.Lock()  # the accepting thread adds to `_joining`
        self._sender = PeerSender(self._broken)
        self._joining: list[Connection] = []
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._readable = selectors.DefaultSelector()  # every peer's pipe and the wake pipe, polled between steps
        self._readable.register(conn, selectors.EVENT_READ)
        self._readable.register(self._wake_r, selectors.EVENT_READ)
        self._listener = listener
        if listener is not None:
            threading.Thread(target=self._accept, args=(listener,), name="mtpserve-engine-accept", daemon=True).start()
        engine.on_tokens = self._send_outputs
        engine.health_listeners.append(self._send_health)

    def run(self) -> None:
        """Serve until the primary peer sends STOP or its end of the pipe closes."""
        try:
            while not self.peer_gone:
                idle = not self.engine.has_unfinished()
                if idle:
                    self._send_state()  # before waiting: every peer sees the engine at rest
                if not self._apply_commands(block=idle):
                    break
                if self.engine.has_unfinished():
                    self._step()
            for rid in list(self.owner):
                self.engine.abort(rid)
            self.owner.clear()
            load = engine_load(self.engine)
            for peer in self.peers:
                self._send_to(peer, (STOPPED, load))
        finally:
            self._sender.flush()
            self._sender.stop()
            self._readable.close()
            if self._listener is not None:
                with contextlib.suppress(OSError):
                    self._listener.close()
            self.engine.health_listeners.remove(self._send_health)
            if self.engine.on_tokens == self._send_outputs:
                self.engine.on_tokens = None  # another peer may drive the engine next

    # ---- peers joining and leaving ----------------------------------------------------------------
    def _accept(self, listener: Listener) -> None:
        """Take front ends that connect, until the listener closes; the engine's thread adopts them."""
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                return
            except Exception:  # a bad handshake (wrong key): refuse that one, keep listening
                log.warning("refused a connection to the engine", exc_info=True)
                continue
            with self._joining_lock:
                self._joining.append(conn)
            with contextlib.suppress(OSError):
                self._wake_w.send_bytes(b"j")

    def _adopt(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
        with self._joining_lock:
            joining, self._joining = self._joining, []
        for conn in joining:
            peer = Peer(conn, streams=True, primary=False)
            try:
                send_ready(self.engine, conn)
            except OSError:
                conn.close()
                continue
            self.peers.append(peer)
            self._readable.register(conn, selectors.EVENT_READ)
            log.info("a front end joined (%d peers)", len(self.peers))

    def _leave(self, peer: Peer, answer: bool) -> None:
        """A peer other than the primary left: abort its requests (their KV blocks are freed now)."""
        for rid in peer.live:
            self.owner.pop(rid, None)
            self.engine.abort(rid)
        peer.live.clear()
        if answer:
            self._send_to(peer, (STOPPED, engine_load(self.engine)))
        self.peers.remove(peer)
        self._readable.unregister(peer.conn)
        for other in self.peers:
            other.stale = True  # its requests' blocks are free now
        self._sender.close(peer.conn)
        log.info("a front end left (%d peers)", len(self.peers))

    # ---- commands -----------------------------------------------------------------------------------
    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when `block`); False when the primary peer stops or its
        pipe closes."""
        ready = {key.fileobj for key, _ in self._readable.select(None if block else 0)}
        if self._wake_r in ready:
            self._adopt()
        for peer in list(self.peers):
            if peer.conn not in ready:
                continue
            try:
                while peer.conn.poll():
                    msg = peer.conn.recv()
                    for cmd in msg[1] if msg[0] == BATCH else [msg]:
                        if cmd[0] == STOP:
                            if peer.primary:
                                return False
                            self._leave(peer, answer=True)
                            break
                        self._apply(peer, cmd)
                    else:
                        continue
                    break
            except (EOFError, OSError):
                if peer.primary:
                    self.peer_gone = True
                    return False
                self._leave(peer, answer=False)
        return True

    def _apply(self, peer: Peer, msg: tuple[Any, ...]) -> None:
        if msg[0] == ABORT:
            rid = msg[1]
            if self.owner.get(rid) is peer:
                del self.owner[rid]
                peer.live.discard(rid)
                self.engine.abort(rid)
            self._send_to(peer, (ABORTED, rid, engine_load(self.engine)))  # the freed blocks show before the next step
            for other in self.peers:
                other.stale = other.stale or other is not peer
            return
        _, seq, rid, ids, params = msg
        try:
            self.engine.add_request(ids, params, rid)
        except Exception as exc:
            self._send_to(peer, (ADDED, seq, portable(exc)))
            return
        self.owner[rid] = peer
        peer.live.add(rid)
        self._send_to(peer, (ADDED, seq, None))

    # ---- steps and what they send -----------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            err = step_error(exc)
            log.exception("engine step failed; failing %d in-flight requests", len(self.owner))
            for rid in list(self.owner):
                try:
                    self.engine.abort(rid)
                except Exception:  # the engine may be broken; keep ending the rest
                    log.exception("abort of %s after an engine failure raised", rid)
            self.owner.clear()
            for peer in self.peers:
                peer.live.clear()
            self.engine.scheduler.forget_cached()  # the KV those keys point at may be gone
            msg = (FAIL, portable(err), engine_load(self.engine))
            for peer in list(self.peers):
                self._send_to(peer, msg)
            return
        self._send_outputs(outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """Each peer its requests' outputs with the engine state: a primary front end every step, other peers when
        they have outputs or have not heard for STATE_EVERY_S."""
        mine: dict[int, list[RequestOutput]] = {}
        first = self.peers[0] if self.peers and self.peers[0].primary and self.peers[0].streams else None
        for o in outputs:
            peer = self.owner.get(o.request_id)
            if peer is None:
                continue
            if o.finished:
                del self.owner[o.request_id]
                peer.live.discard(o.request_id)
            mine.setdefault(id(peer), []).append(o)
        load = engine_load(self.engine)
        now = time.monotonic()
        for peer in list(self.peers):
            own = mine.get(id(peer))
            if own is None and peer is not first and now - peer.heard_at < STATE_EVERY_S:
                peer.stale = True
                continue
            peer.heard_at, peer.stale = now, False
            self._send_to(peer, (OUT, pack_outputs(own or []), load))

    def _send_state(self) -> None:
        """The engine state to every peer that has not heard it since it changed."""
        stale = [p for p in self.peers if p.stale]
        if not stale:
            return
        load = engine_load(self.engine)
        for peer in stale:
            peer.heard_at, peer.stale = time.monotonic(), False
            self._send_to(peer, (OUT, [], load))

    def _send_health(self, ok: bool) -> None:
        for peer in list(self.peers):
            self._send_to(peer, (HEALTH, ok))

    def _send_to(self, peer: Peer, msg: tuple[Any, ...]) -> None:
        self._sender.send(peer.conn, msg)

    def _broken(self, conn: Connection) -> None:
        """A write to `conn` failed: when it is the primary peer's, serving ends (another peer's failure shows as
        its pipe closing, and it leaves then)."""
        if any(p.primary and p.conn is conn for p in self.peers):
            self.peer_gone = True


class EngineThread:
    """An engine of this process (the Ray scheduler actor's) served to front ends that connect on `address`,
    from a thread; `control` is the pipe that stops it (the actor's own front ends, or the engine of one replica
    that another process's front ends serve). With `drained`, nobody here reads `control`: a thread of its own
    takes what the engine says on it (READY, its state), so that the engine never waits on a full pipe."""

    def __init__(self, engine: LLMEngine, address: tuple[str, bytes], drained: bool = False) -> None:
        self.control, engine_end = mp.Pipe()
        unlink_socket(address[0])  # a restarted actor listens where its last life did
        listener = Listener(address[0], family="AF_UNIX", authkey=address[1])
        self._engine = engine
        self._piped = PipedEngine(engine, engine_end, streams=False, listener=listener)
        self._thread = threading.Thread(target=self._run, args=(engine_end,), name="mtpserve-piped-engine", daemon=True)
        self._thread.start()
        if drained:
            threading.Thread(target=self._drain, name="mtpserve-engine-drain", daemon=True).start()

    def _drain(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while self.control.recv()[0] != STOPPED:
                pass

    def _run(self, engine_end: Connection) -> None:
        try:
            # from this thread: READY carries the tokenizer, more than a pipe holds, and the pool reads it only
            # once this object is built
            send_ready(self._engine, engine_end)
            self._piped.run()
        except Exception:
            log.exception("serving the engine to the front ends failed")
        finally:
            engine_end.close()

    pid = None  # the engine runs in this process

    def status(self) -> str:
        """How it ended, for errors and logs."""
        return "the engine's thread stopped"

    def join(self, timeout: float) -> None:
        """Wait for it to end after STOP."""
        self._thread.join(timeout)

    def again(self) -> None:
        """None: an engine of this process is not built again here."""

    def close(self) -> None:
        """Nothing to release."""

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving the engine (its front ends' requests end) and wait for the thread."""
        with contextlib.suppress(OSError):
            self.control.send((STOP,))
        self.join(timeout)
