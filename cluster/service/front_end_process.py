"""A front-end process started by this one (spawned, so it imports only the front ends: front_end_child.py), and
how its start is awaited: the pool's front ends here, the Ray scheduler actor's in actor_front_ends.py."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mtpserve.cluster.engine.errors import MTPServeError
from mtpserve.cluster.service.child_link import ERROR, spawn_child
from mtpserve.cluster.service.front_end_child import STOP_SERVING
from mtpserve.cluster.service.pool_engines import EngineSlots
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
START_TIMEOUT_S = 300.0
FRONT_END_ENTRY = "mtpserve.cluster.service.front_end_child:run_front_ends"


class FrontEndError(MTPServeError):
    """The front ends' process could not start."""


def wait_serving(control: Connection, proc: BaseProcess, name: str) -> tuple[Any, ...]:
    """The SERVING message a front-end process sends on `control` once it serves; FrontEndError (or the child's
    own error) when it cannot start."""
    try:
        if not control.poll(START_TIMEOUT_S):
            raise FrontEndError(f"{name} did not start within {START_TIMEOUT_S:.0f} s")
        msg = control.recv()
    except (EOFError, OSError):
        proc.join(5.0)
        raise FrontEndError(f"{name} exited with code {proc.exitcode}") from None
    if msg[0] == ERROR:
        raise msg[1]
    return msg


class FrontEnd:
    """One front-end process of the pool, and the pipe it reports on."""

    def __init__(self, cfg: MTPServeConfig, engines: EngineSlots, index: int, metrics_dir: str) -> None:
        self.index = index
        self._send_lock = threading.Lock()
        self.control, child_control = mp.Pipe()
        args = (cfg, engines, child_control, os.getpid(), logging.getLogger().getEffectiveLevel(), f"front end {index}")
        with _environ(MULTIPROC_ENV, metrics_dir):  # the child's metrics go to the shared files
            self.proc = spawn_child(FRONT_END_ENTRY, args, f"mtpserve-front-end-{index}")
        child_control.close()

    def wait_serving(self) -> tuple[int, int | None]:
        """The gRPC and HTTP ports it bound, once it serves; FrontEndError (or its own error) if it cannot."""
        msg = wait_serving(self.control, self.proc, f"front end {self.index}")
        return msg[4], msg[5]

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send on its control pipe (from any thread); nothing if the pipe is closed."""
        with self._send_lock, contextlib.suppress(OSError):
            self.control.send(msg)

    def stop(self, timeout: float) -> None:
        """Ask it to stop (its streams end as at any server stop); kill it past `timeout` s."""
        self.send((STOP_SERVING,))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.control.close()


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` in this process's environment for the block (a spawned child copies it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
