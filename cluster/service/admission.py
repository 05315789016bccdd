"""What a front end lets onto its ports: a cap on open HTTP connections that makes room by closing the oldest idle
one (so connections that send nothing cannot lock out a client), the file budget both ports share, and accept
errors logged once per interval instead of once per attempt."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)
RESERVED_FILES = 256  # model files, pipes, sockets of the engine link, Ray and the metrics port
LOG_INTERVAL_S = 10.0
REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def open_file_limit() -> int:
    """This process's soft limit on open files."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(configured: int | None, file_limit: int) -> int:
    """Connections each port of one front end holds open: `configured`, or half of the files left after a
    reserve, so that HTTP and gRPC together never run the process out of files (at least 16)."""
    if configured is not None:
        return configured
    return max(16, (file_limit - RESERVED_FILES) // 2)


class Refused(asyncio.Protocol):
    """A connection turned away: answered 503 and closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send the refusal and close."""
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(REFUSAL)
        transport.close()


class Counted(asyncio.Protocol):
    """One connection's protocol (aiohttp's request handler) with its opening and closing told to the cap."""

    def __init__(self, inner: Any, cap: ConnectionCap) -> None:
        self.inner = inner
        self.cap = cap
        self.made = False
        self.dropped = False  # closed by the cap before it was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Hand the connection on, or close it if the cap dropped it meanwhile."""
        if self.dropped:
            transport.close()
            return
        self.made = True
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and hand its end on."""
        self.cap.closed(self)
        if self.made:
            self.inner.connection_lost(exc)

    def close(self) -> None:
        """Close the connection now, or as soon as it is made."""
        if self.made:
            self.inner.force_close()
        else:
            self.dropped = True

    def data_received(self, data: bytes) -> None:
        """Hand the bytes on."""
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        """Hand the end of input on."""
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        """Hand the flow control on."""
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        """Hand the flow control on."""
        self.inner.resume_writing()


class ConnectionCap:
    """The HTTP protocol factory, capped at `limit` open connections. At the cap a new connection closes the oldest
    one with no request in progress (idle, still sending its headers, or in its TLS handshake); when every one is
    busy the new one is refused with 503. `middleware` marks the connections with a request in progress."""

    def __init__(self, make: Callable[[], Any], limit: int, handshake_s: float) -> None:
        self._make = make
        self.limit = limit
        self.handshake_s = handshake_s  # TLS handshakes that take longer are dropped
        self._open: dict[Counted, None] = {}  # oldest first
        self._busy: set[Any] = set()  # request handlers with a request in progress
        self.evicted = 0
        self.refused = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._open) >= self.limit and not self._make_room():
            self.refused += 1
            return Refused()
        conn = Counted(self._make(), self)
        self._open[conn] = None
        return conn

    @property
    def open(self) -> int:
        """Connections open now, or accepted and still in their handshake."""
        return len(self._open)

    def closed(self, conn: Counted) -> None:
        """Forget a closed connection."""
        self._open.pop(conn, None)

    def _make_room(self) -> bool:
        victim = next((c for c in self._open if c.inner not in self._busy), None)
        if victim is None:
            return False
        del self._open[victim]
        victim.close()
        self.evicted += 1
        return True

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Mark the request's connection busy while its handler runs."""
        conn = request.protocol
        self._busy.add(conn)
        try:
            return await handler(request)
        finally:
            self._busy.discard(conn)


class CappedTCPSite(web.TCPSite):
    """aiohttp's TCP site with its connections made by a ConnectionCap."""

    def __init__(self, runner: web.BaseRunner, cap: ConnectionCap, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self.cap = cap

    async def start(self) -> None:
        """Register with the runner and listen, each connection going through the cap."""
        await web.BaseSite.start(self)
        self._server = await asyncio.get_running_loop().create_server(
            self.cap,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=self.cap.handshake_s if self._ssl_context else None,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


class AcceptErrorLog:
    """An event-loop exception handler that logs each accept error (`socket.accept() out of system resource`, which
    asyncio reports at every try) at most once per `interval` seconds, with a count of the repeats it held back;
    other errors pass straight to the default handler."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if not message.startswith("socket.accept()"):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last.get(message, -self.interval) < self.interval:
            self._held[message] = self._held.get(message, 0) + 1
            return
        self._last[message] = now
        held = self._held.pop(message, 0)
        if held:
            context = {**context, "message": f"{message} (and {held} more in the last {self.interval:g} s)"}
        loop.default_exception_handler(context)
