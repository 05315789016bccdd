"""The long-lived per-step link between the scheduler and a target rank.

Every step message is a serialized `StepRequest` one way and a `TargetOutput` the other. On the
scheduler's node the link is a Unix socket carrying length-prefixed frames: a blocking send and receive
in the calling threads, with no thread hand-off and no per-call set-up. Across nodes it is one
bidirectional gRPC stream (`TargetWorker.Steps`). Both carry the same messages in the same order.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from proto.mtpserve.v1 import worker_pb2 as wpb
from proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from workers.grpc_util import channel_options

_HEADER = struct.Struct("<I")


class LinkClosed(ConnectionError):
    """The other end closed the link, or it broke."""


class FrameSocket:
    """Length-prefixed frames over a connected stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, payload: bytes) -> None:
        """Send one frame."""
        try:
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        except OSError as exc:
            raise LinkClosed(str(exc)) from None

    def recv(self, timeout: float | None = None) -> bytes:
        """The next frame; TimeoutError after `timeout` seconds without one, LinkClosed at end of stream."""
        self.sock.settimeout(timeout)
        (n,) = _HEADER.unpack(self._exactly(_HEADER.size))
        self.sock.settimeout(None)  # a frame that has started arrives whole
        return bytes(self._exactly(n))

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise
            except OSError as exc:
                raise LinkClosed(str(exc)) from None
            if k == 0:
                raise LinkClosed("the other end closed the link")
            got += k
        return buf

    def close(self) -> None:
        """Close the socket."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Serve = Callable[[Iterator[wpb.StepRequest]], Iterator[wpb.TargetOutput]]


class StepListener:
    """A worker's Unix-socket endpoint: each connection is served by `serve` on its own thread."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.name = f"mtpserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)  # the abstract namespace: nothing to clean up on disk
        self._sock.listen(4)
        threading.Thread(target=self._accept, name="mtpserve-step-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(FrameSocket(conn),), name="mtpserve-steps", daemon=True).start()

    def _serve(self, link: FrameSocket) -> None:
        def requests() -> Iterator[wpb.StepRequest]:
            while True:
                try:
                    frame = link.recv()
                except LinkClosed:
                    return
                yield wpb.StepRequest.FromString(frame)

        try:
            for reply in self.serve(requests()):
                link.send(reply.SerializeToString())
        except LinkClosed:
            pass
        finally:
            link.close()

    def close(self) -> None:
        """Stop accepting connections."""
        self._sock.close()


class StepLink(Protocol):
    """The scheduler's end of a link to one rank."""

    def send(self, request: wpb.StepRequest) -> int:
        """Send a request; returns its size in bytes."""
        ...

    def recv(self, timeout: float) -> tuple[wpb.TargetOutput, int]:
        """The next reply and its size; TimeoutError after `timeout` s, LinkClosed when the rank is gone."""
        ...

    def close(self) -> None:
        """Release the link."""
        ...


class SocketLink:
    """A link over the rank's Unix socket (same node)."""

    def __init__(self, name: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + name)
        self.frames = FrameSocket(sock)

    def send(self, request: wpb.StepRequest) -> int:
        """Send a request; returns its size in bytes."""
        data = request.SerializeToString()
        self.frames.send(data)
        return len(data)

    def recv(self, timeout: float) -> tuple[wpb.TargetOutput, int]:
        """The next reply and its size."""
        data = self.frames.recv(timeout)
        return wpb.TargetOutput.FromString(data), len(data)

    def close(self) -> None:
        """Close the socket; the rank drops its launched step."""
        self.frames.close()


class GrpcStreamLink:
    """A link over one bidirectional `TargetWorker.Steps` stream (any node)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address, channel_options())
        self._out: queue.Queue[wpb.StepRequest | None] = queue.Queue()
        self._in: queue.Queue[wpb.TargetOutput | Exception] = queue.Queue()
        replies = wpb_grpc.TargetWorkerStub(self._channel).Steps(iter(self._out.get, None))
        threading.Thread(target=self._read, args=(replies,), name="mtpserve-step-stream", daemon=True).start()

    def _read(self, replies: Iterator[wpb.TargetOutput]) -> None:
        try:
            for r in replies:
                self._in.put(r)
            self._in.put(LinkClosed("the rank ended the step stream"))
        except grpc.RpcError as exc:
            self._in.put(LinkClosed(f"{exc.code().name}: {exc.details()}"))

    def send(self, request: wpb.StepRequest) -> int:
        """Queue a request on the stream; returns its size in bytes."""
        self._out.put(request)
        return request.ByteSize()

    def recv(self, timeout: float) -> tuple[wpb.TargetOutput, int]:
        """The next reply and its size."""
        try:
            item = self._in.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply within {timeout:g} s") from None
        if isinstance(item, Exception):
            self._in.put(item)  # every later call fails the same way
            raise item
        return item, item.ByteSize()

    def close(self) -> None:
        """End the stream and the channel."""
        self._out.put(None)
        self._channel.close()


def connect(address: str, socket_name: str, same_node: bool) -> StepLink:
    """The fastest link to a rank: its Unix socket on this node, else the gRPC stream at `address`."""
    if same_node and socket_name:
        return SocketLink(socket_name)
    return GrpcStreamLink(address)
