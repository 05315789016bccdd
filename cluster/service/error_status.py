"""One mapping of the engine's exceptions to what each API answers: an HTTP status and a gRPC status code, with a
message that names the request field where there is one."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from mtpserve.cluster.engine.errors import InvalidRequestError, QueueFullError, WorkerUnavailableError
from mtpserve.cluster.service.request_book import EngineFailure, ServerShuttingDown


@dataclass(frozen=True)
class ErrorStatus:
    """How a request that failed with an exception is answered."""

    http: int
    grpc: grpc.StatusCode
    reason: str
    field: str | None = None  # the request field at fault (a client error), as the engine names it

    def message(self, field: str | None = None) -> str:
        """The reason, prefixed with `field` (the API's name for `self.field`) when a field is at fault."""
        name = field or self.field
        return f"{name}: {self.reason}" if name else self.reason


def error_status(exc: BaseException) -> ErrorStatus:
    """The answer to a request that failed with `exc`."""
    if isinstance(exc, InvalidRequestError):
        return ErrorStatus(400, grpc.StatusCode.INVALID_ARGUMENT, exc.reason, exc.field)
    if isinstance(exc, QueueFullError):
        return ErrorStatus(429, grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {exc}")
    if isinstance(exc, WorkerUnavailableError):
        return ErrorStatus(503, grpc.StatusCode.UNAVAILABLE, f"workers are down: {exc}")
    if isinstance(exc, EngineFailure | ServerShuttingDown):
        return ErrorStatus(503, grpc.StatusCode.UNAVAILABLE, str(exc))
    return ErrorStatus(500, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
