"""mtpserve: speculative-decoding LLM inference on Ray with an MTP Eagle draft head.

The installed import package. Its sub-packages are the repository's top-level folders: `mtpserve.cluster` (the
service), `mtpserve.workers`, `mtpserve.speculative`, `mtpserve.modeling`, `mtpserve.proto` and `mtpserve.deploy`.
`mtpserve.MTPServeClient` is the Python client of the gRPC API; it is imported on first use, so importing a
sub-package does not load gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtpserve.cluster.service.client import MTPServeClient

__all__ = ["MTPServeClient"]


def __getattr__(name: str) -> Any:
    """`mtpserve.MTPServeClient`, loaded when first asked for."""
    if name == "MTPServeClient":
        from mtpserve.cluster.service.client import MTPServeClient

        return MTPServeClient
    raise AttributeError(f"module 'mtpserve' has no attribute {name!r}")
