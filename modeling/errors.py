"""The errors the model layer raises, and the base class of every error mtpserve reports to callers."""

from __future__ import annotations


class MTPServeError(Exception):
    """Base class for errors that mtpserve reports to callers."""


class ModelLoadError(MTPServeError):
    """A model could not be found or read; the message says how to fix it."""
