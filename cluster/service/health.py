"""grpc.health.v1 on the front-end event loop, answering from the server's live state: Check reads it on every
call, Watch sends it again whenever `changed()` is called (from any thread)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

WATCH_RECHECK_S = 1.0


class LiveHealth(health_pb2_grpc.HealthServicer):
    """Reports SERVING while `serving()` is true for every name in `services` ("" is the whole server); other
    names are NOT_FOUND to Check and SERVICE_UNKNOWN to Watch."""

    def __init__(
        self,
        serving: Callable[[], bool],
        services: Iterable[str],
        loop: asyncio.AbstractEventLoop,
        max_watches: int = 64,
    ) -> None:
        self._serving = serving
        self._services = {"", *services}
        self._loop = loop
        self._changed = asyncio.Event()
        self._shutting_down = False
        self.max_watches = max_watches  # Watch streams held at once: unauthenticated, they must not fill the server
        self._watching = 0

    def status(self, service: str) -> int:
        """The status a Check of `service` returns now."""
        if service not in self._services:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        ok = self._serving() and not self._shutting_down
        return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING

    def changed(self) -> None:
        """Tell watchers the state may have changed (any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody watches any more
            self._loop.call_soon_threadsafe(self._wake)

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING from now on."""
        self._shutting_down = True
        self.changed()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        """The service's status now; NOT_FOUND for an unknown service."""
        if request.service not in self._services:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=self.status(request.service))

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The status now, then each change of it, until the client leaves or the server shuts down. Past
        `max_watches` streams at once a new one ends with RESOURCE_EXHAUSTED (Check still answers)."""
        if self._watching >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_watches} Health.Watch streams are open already; use Health.Check",
            )
        self._watching += 1
        try:
            async for reply in self._watch(request.service):
                yield reply
        finally:
            self._watching -= 1

    async def _watch(self, service: str) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            changed, down = self._changed, self._shutting_down  # read before the status, which then reflects both
            status = self.status(service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if down:
                return
            with contextlib.suppress(asyncio.TimeoutError):  # a change nobody announced is seen within a second
                await asyncio.wait_for(changed.wait(), WATCH_RECHECK_S)
