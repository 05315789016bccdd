"""`cluster.client.MTPServeClient`, the public import path of the Python client (`cluster/service/client.py`)."""

from cluster.service.client import MTPServeClient

__all__ = ["MTPServeClient"]
