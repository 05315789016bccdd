"""The front ends beside an engine that stays where it is: the Ray scheduler actor keeps its distributed engine
(and its workers) and steps it on a thread, while a spawned child serves gRPC, HTTP and metrics over a pipe to it
(engine_child.PipedEngine on this side, front_end_child.run_front_ends in the child). The two no longer share one
interpreter lock."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.child_link import spawn_child
from mtpserve.cluster.service.engine_child import PipedEngine, send_ready
from mtpserve.cluster.service.front_end_child import STOP_SERVING
from mtpserve.cluster.service.front_end_process import FRONT_END_ENTRY, wait_serving
from mtpserve.workers.config import MTPServeConfig

log = logging.getLogger(__name__)


class FrontEndProcess:
    """Serves `engine` through front ends in a spawned child, bound as `cfg.server` says (raising the child's
    error if they cannot start). `on_lost` is called if the child dies while serving."""

    def __init__(self, engine: LLMEngine, cfg: MTPServeConfig, on_lost: Callable[[], None]) -> None:
        engine_end, child_engine_end = mp.Pipe()
        self._control, child_control = mp.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        args = (cfg, child_engine_end, child_control, os.getpid(), level)
        self._proc = spawn_child(FRONT_END_ENTRY, args, "mtpserve-front-ends")
        child_engine_end.close()
        child_control.close()
        self._on_lost = on_lost
        self._drain_s = cfg.server.drain_timeout_s
        self._lock = threading.Lock()
        self._stopping = False
        self._serving = False
        self._engine_end = engine_end
        self._thread = threading.Thread(target=self._serve_engine, name="mtpserve-piped-engine", daemon=True)
        try:
            send_ready(engine, engine_end)
            self._engine = PipedEngine(engine, engine_end)
            self._thread.start()  # a child that fails to start stops the engine side through the pipe
            self.address, self.metrics_port, self.http_address = self._wait_serving()
        except BaseException:
            self._stopping = True
            self._proc.kill()
            self._proc.join(5.0)
            self._close()
            raise
        with self._lock:  # the child may have died already: then it is lost now
            self._serving = True
            lost = not self._thread.is_alive()
        if lost:
            self._lost()

    @property
    def pid(self) -> int | None:
        """The front-end process's id."""
        return self._proc.pid

    def _wait_serving(self) -> tuple[str, int | None, str | None]:
        msg = wait_serving(self._control, self._proc, "the front-end process")
        return msg[1], msg[2], msg[3]

    def _serve_engine(self) -> None:
        try:
            self._engine.run()
        except Exception:
            log.exception("serving the engine to the front ends failed")
        finally:
            self._engine_end.close()  # the front ends see the pipe close
            with self._lock:
                lost = self._serving and not self._stopping
            if lost:
                self._lost()

    def _lost(self) -> None:
        log.error("the front-end process is gone; nothing serves this engine any more")
        self._on_lost()

    def _close(self) -> None:
        for conn in (self._control, self._engine_end):
            conn.close()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the front ends (they drain their streams first), then the engine side."""
        if timeout is None:
            timeout = self._drain_s + 15.0
        with self._lock:
            self._stopping = True
        with contextlib.suppress(OSError):
            self._control.send((STOP_SERVING,))
        self._thread.join(timeout)
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._close()
