"""The serving process's front-end thread: one asyncio event loop that hosts the gRPC server (grpc.aio) and the
HTTP API (aiohttp), so every stream is a coroutine on one thread and the engine thread wakes it once per step."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from mtpserve.cluster.service.admission import AcceptErrorLog, CappedTCPSite, ConnectionCap

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0
T = TypeVar("T")


class FrontEndThread:
    """A daemon thread running one asyncio event loop until `stop`."""

    def __init__(self, name: str = "mtpserve-front-end") -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(AcceptErrorLog())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread and its loop."""
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[T]], timeout: float = START_TIMEOUT_S) -> T:
        """Run a coroutine on the loop from another thread and return its result (or raise its error)."""

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, teardown: Callable[[], Awaitable[None]] | None = None, timeout: float = 15.0) -> None:
        """Run `teardown` on the loop, cancel what is left, and end the thread."""
        if not self._thread.is_alive():
            if self._thread.ident is None and not self.loop.is_closed():
                self.loop.close()  # never started
            return
        if teardown is not None:
            try:
                self.call(teardown, timeout)
            except Exception:
                log.exception("front-end shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            except Exception:
                log.exception("front-end loop shutdown")
            finally:
                self.loop.close()


class HTTPSite:
    """The aiohttp application `make_app` builds, bound to `host:port` (0 picks a free port) on the running loop.

    Handlers are cancelled when their client disconnects (aiohttp's handler_cancellation), so a handler can
    release what its request holds in a `finally`. At most `max_connections` stay open (ConnectionCap)."""

    def __init__(
        self,
        make_app: Callable[[], web.Application],
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
        grace: float = 1.0,
        reuse_port: bool = False,
        idle_timeout: float = 15.0,
        max_connections: int = 1024,
    ) -> None:
        self._make_app = make_app
        self.host = host
        self.port = port
        self._ssl = ssl_context
        self._backlog = backlog
        self._grace = grace
        self._reuse_port = reuse_port
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._runner: web.AppRunner | None = None
        self.cap: ConnectionCap | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port. OSError when the port cannot be bound."""
        app = self._make_app()
        self._runner = runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self._grace,
            keepalive_timeout=self._idle_timeout,  # also closes a connection that sends no whole request
        )

        def make_handler() -> web.RequestHandler:
            assert runner.server is not None
            return runner.server()

        self.cap = ConnectionCap(make_handler, self._max_connections, self._idle_timeout)
        app.middlewares.append(self.cap.middleware)
        await self._runner.setup()
        site = CappedTCPSite(
            self._runner,
            self.cap,
            host=self.host,
            port=self.port,
            ssl_context=self._ssl,
            backlog=self._backlog,
            reuse_port=self._reuse_port or None,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        """Stop listening, give open requests `grace` seconds, cancel the rest (their handlers clean up)."""
        if self._runner is not None:
            await self._runner.cleanup()
