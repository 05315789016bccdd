"""An aiohttp application served from its own thread and asyncio event loop inside the serving process."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable

from aiohttp import web

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class HTTPServer:
    """Binds `host:port` (0 picks a free port) on a thread of its own and serves the app `make_app` builds.

    Handlers are cancelled when their client disconnects (aiohttp's handler_cancellation), so a handler
    can release what its request holds in a `finally`.
    """

    def __init__(
        self,
        make_app: Callable[[], web.Application],
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
        grace: float = 1.0,
    ) -> None:
        self._make_app = make_app
        self.host = host
        self.port = port
        self._ssl = ssl_context
        self._backlog = backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, name="mtpserve-http", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._grace = grace

    def start(self) -> int:
        """Start serving; returns the bound port. OSError when the port cannot be bound."""
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise self._error
        return self.port

    def stop(self) -> None:
        """Stop listening, give open requests `grace` seconds, cancel the rest (their handlers clean up)."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(self._grace + 10.0)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._bind())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._shutdown(loop)

    def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_default_executor())
        except Exception:
            log.exception("HTTP server shutdown")
        finally:
            loop.close()

    async def _bind(self) -> None:
        self._runner = web.AppRunner(
            self._make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=self._grace
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl, backlog=self._backlog)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
