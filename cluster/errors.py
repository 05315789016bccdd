"""Typed errors the engine raises; the gRPC layer maps each to a status code."""

from __future__ import annotations


class MTPServeError(Exception):
    """Base class for errors that mtpserve reports to callers."""


class InvalidRequestError(MTPServeError, ValueError):
    """A request field is invalid; maps to gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class QueueFullError(MTPServeError):
    """The waiting queue is at its bound; maps to gRPC RESOURCE_EXHAUSTED."""


class WorkerUnavailableError(MTPServeError):
    """A worker actor is down; maps to gRPC UNAVAILABLE."""


class ModelLoadError(MTPServeError):
    """A model could not be found or read; the message says how to fix it."""


class PlacementError(MTPServeError):
    """The Ray cluster cannot host the workers the config asks for; the message names the settings."""
