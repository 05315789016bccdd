"""`mtpserve.cluster.client.MTPServeClient`, also `mtpserve.MTPServeClient`: the Python client (`service/client.py`)."""

from mtpserve.cluster.service.client import Chat, MTPServeClient

__all__ = ["Chat", "MTPServeClient"]
