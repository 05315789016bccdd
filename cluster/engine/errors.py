"""Typed errors the engine raises; the gRPC layer maps each to a status code.

The base class and the model-load error live in the model layer (modeling/errors.py), which raises it."""

from __future__ import annotations

from pydantic import ValidationError

from mtpserve.modeling.errors import ModelLoadError, MTPServeError

__all__ = [
    "ConfigError",
    "InvalidRequestError",
    "MTPServeError",
    "ModelLoadError",
    "PlacementError",
    "QueueFullError",
    "WorkerUnavailableError",
    "invalid_field",
]


class InvalidRequestError(MTPServeError, ValueError):
    """A request field is invalid; maps to gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.field, self.reason)  # pickles across processes with both fields


def invalid_field(exc: ValidationError, prefix: str = "") -> InvalidRequestError:
    """The first error of a pydantic validation as an InvalidRequestError naming `prefix` + the field's path
    (list items as `[i]`: `messages[0].role`), with pydantic's message starting in lower case."""
    err = exc.errors()[0]
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    field = f"{prefix}{path}" if path else prefix.rstrip(".") or "request"
    msg = err["msg"].removeprefix("Value error, ")
    return InvalidRequestError(field, msg[:1].lower() + msg[1:])


class ConfigError(MTPServeError):
    """A configured file or value cannot be used at start-up; the message names the config field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.field, self.reason)  # pickles across processes with both fields


class QueueFullError(MTPServeError):
    """The waiting queue is at its bound; maps to gRPC RESOURCE_EXHAUSTED."""


class WorkerUnavailableError(MTPServeError):
    """A worker actor is down; maps to gRPC UNAVAILABLE."""


class PlacementError(MTPServeError):
    """The Ray cluster cannot host the workers the config asks for; the message names the settings."""
