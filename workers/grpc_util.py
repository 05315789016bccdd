"""Small gRPC helpers shared by the worker servers and their clients."""

from __future__ import annotations

from concurrent import futures

import grpc

MAX_MESSAGE_BYTES = 512 * 1024 * 1024


def channel_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Raised message-size limits for step messages (hidden states can be large)."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


def start_server(register: object, host: str = "0.0.0.0", threads: int = 4) -> tuple[grpc.Server, int]:
    """Start a gRPC server on a free port; `register(server)` adds the servicers. Returns (server, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=channel_options())
    register(server)  # type: ignore[operator]
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port


def node_ip() -> str:
    """This node's address as Ray sees it (loopback outside Ray)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"
