"""The engine process's outgoing messages, pickled and written by a thread of their own (`PeerSender`).

Each step the engine sends every front end its requests' new tokens with the engine state. Pickling and writing
those messages on the engine's thread took about a sixth of its time at 64 streams (SmolLM2 on an H100, py-spy,
`bench/device_run.sh serveprof`); on this thread they run while the engine's thread waits for the GPU, which
releases the interpreter lock. Messages to one connection keep their order; a full queue (a front end that does
not read) makes the engine wait, as a full pipe did before."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)
MAX_QUEUED = 4096  # messages waiting to be written, over all connections
_CLOSE, _FLUSH, _STOP = object(), object(), object()


class PeerSender:
    """Writes messages to connections from one thread, in the order they were queued. `on_broken` hears each
    connection a write failed on (once per failed write)."""

    def __init__(self, on_broken: Callable[[Connection], None]) -> None:
        self._queue: queue.Queue[tuple[Connection | None, Any]] = queue.Queue(MAX_QUEUED)
        self._on_broken = on_broken
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine-sender", daemon=True)
        self._thread.start()

    def send(self, conn: Connection, msg: tuple[Any, ...]) -> None:
        """Queue `msg` for `conn` (waits while the queue is full)."""
        self._queue.put((conn, msg))

    def close(self, conn: Connection) -> None:
        """Close `conn` once what was queued for it before is written."""
        self._queue.put((conn, _CLOSE))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or failed); False past `timeout` s."""
        done = threading.Event()
        self._queue.put((None, (_FLUSH, done)))
        return done.wait(timeout)

    def stop(self) -> None:
        """End the thread once what was queued before is written."""
        self._queue.put((None, (_STOP, None)))
        self._thread.join(10.0)

    def _run(self) -> None:
        while True:
            conn, msg = self._queue.get()
            if conn is None:
                if msg[0] is _STOP:
                    return
                msg[1].set()
                continue
            try:
                if msg is _CLOSE:
                    conn.close()
                else:
                    conn.send(msg)
            except OSError:
                self._on_broken(conn)
            except Exception:  # a message that does not pickle: a bug, but the others must still go out
                log.exception("sending %s to a peer failed", type(msg).__name__)
