"""The engines a FrontEndPool serves, each listening on a Unix socket for its front ends: one built in a child
process (`EngineChild`), one of this process served from a thread (`EngineThread`, the Ray scheduler actor's), or
one another process serves (`ListeningEngine`: a Ray replica's actor), to which the pool connects only to hear its
state. Each offers `control` (the connection the pool hears the engine's state on and stops it through), `pid`,
`status()`, `join()`, and `again()`: what replaces it once it stopped (None: nothing)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import Protocol

from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.service.child_link import ENGINE_ENTRY, spawn_child
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)
RECONNECT_WAIT_S = 600.0  # how long to wait for a stopped engine to listen again (a model build, an actor restart)
CONNECT_POLL_S = 0.1


class PoolEngine(Protocol):
    """What a FrontEndPool asks of an engine it serves (see the module docstring)."""

    control: Connection

    @property
    def pid(self) -> int | None:
        """The engine's process id, when it has one of its own."""
        ...

    def status(self) -> str:
        """How it ended, for errors and logs."""
        ...

    def join(self, timeout: float) -> None:
        """Wait for it to end after STOP."""
        ...

    def again(self) -> PoolEngine | None:
        """What replaces it once it stopped (None: nothing)."""
        ...

    def close(self) -> None:
        """Release what it holds once it stopped (a Ray replica's actor); idempotent."""
        ...


def unlink_socket(path: str) -> None:
    """Remove a Unix socket file left by an engine that is gone (nothing if there is none)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass
class EngineSlots:
    """The sockets a pool's engines listen at, one per slot, and how many of the first slots run an engine now
    (a scaling pool fills the others as it grows)."""

    addresses: list[tuple[str, bytes]]
    up: int


def engine_addresses(folder: str, count: int, stem: str = "engine") -> list[tuple[str, bytes]]:
    """`count` Unix socket paths in `folder` (`<stem>-<i>.sock`), each with a fresh random key, for engines to
    listen at and front ends to connect to."""
    return [(os.path.join(folder, f"{stem}-{i}.sock"), os.urandom(32)) for i in range(count)]


def connect_engine(address: tuple[str, bytes], wait_s: float) -> Connection:
    """A connection to the engine listening at `address` (a Unix socket and its key), waiting up to `wait_s` s
    for it to listen (an engine being built again); WorkerUnavailableError past that."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Client(address[0], family="AF_UNIX", authkey=address[1])
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise WorkerUnavailableError(f"no engine listens at {address[0]} after {wait_s:.0f} s") from None
            time.sleep(CONNECT_POLL_S)


class ListeningEngine:
    """An engine another process serves at `address` (a Ray replica's scheduler actor); the pool connects to it as
    one more peer, to hear its state. When that process dies, its owner (Ray) starts it again at the same socket,
    and `again()` connects to the new one."""

    def __init__(self, address: tuple[str, bytes], wait_s: float = RECONNECT_WAIT_S) -> None:
        self.address = address
        self.control = connect_engine(address, wait_s)

    pid = None  # the process is its owner's to know

    def status(self) -> str:
        """How it ended, for errors and logs."""
        return f"the engine at {self.address[0]} closed its connection"

    def join(self, timeout: float) -> None:
        """Nothing to wait for: its owner stops it."""

    def again(self) -> ListeningEngine:
        """A connection to the engine started again at the same socket (waits for it to listen)."""
        return ListeningEngine(self.address)

    def close(self) -> None:
        """Nothing to release."""


class EngineChild:
    """The engine built from `cfg` in a spawned process that listens for front ends on `address`; `control` is
    this process's pipe to it."""

    def __init__(self, cfg: MTPServeConfig, address: tuple[str, bytes]) -> None:
        self.cfg, self.address = cfg, address
        unlink_socket(address[0])  # the socket of an engine that died, when this one replaces it
        self.control, child_end = mp.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        self._proc = spawn_child(ENGINE_ENTRY, (cfg, child_end, os.getpid(), level, address), "mtpserve-engine")
        child_end.close()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    def status(self) -> str:
        """How it ended, for errors and logs."""
        self._proc.join(0.5)
        return f"the engine process exited (exit code {self._proc.exitcode})"

    def join(self, timeout: float) -> None:
        """Wait for it to end after STOP; kill it past `timeout` s."""
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5.0)

    def again(self) -> EngineChild:
        """A new engine process in place of this one, at the same socket."""
        return EngineChild(self.cfg, self.address)

    def close(self) -> None:
        """Nothing to release."""
