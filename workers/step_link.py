"""The long-lived per-step links: scheduler to each target rank, and rank 0 to a separate draft worker.

A step message is a serialized `StepRequest` to a rank and a `TargetOutput` back; `DraftInputs` to the
draft worker and `DraftOutputs` back. On one node a link is a Unix socket carrying length-prefixed frames:
a blocking send and receive in the calling threads, with no thread hand-off and no per-call set-up.
Across nodes the scheduler's link is one bidirectional gRPC stream (`TargetWorker.Steps`) carrying the
same messages in the same order, and rank 0 calls the draft worker's `Propose`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import grpc

from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from mtpserve.workers.grpc_util import channel_options

_HEADER = struct.Struct("<I")


class LinkClosed(ConnectionError):
    """The other end closed the link, or it broke."""


class FrameSocket:
    """Length-prefixed frames over a connected stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, payload: bytes, timeout: float | None = None) -> None:
        """Send one frame; TimeoutError when the other end does not take it within `timeout` seconds."""
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        except TimeoutError:
            raise
        except OSError as exc:
            raise LinkClosed(str(exc)) from None

    def recv(self, timeout: float | None = None) -> bytes:
        """The next frame, whole, within `timeout` seconds (None: wait for ever); TimeoutError otherwise,
        LinkClosed at end of stream."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (n,) = _HEADER.unpack(self._exactly(_HEADER.size, deadline))
        return bytes(self._exactly(n, deadline))

    def _exactly(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"a frame did not arrive whole in time ({got} of {n} bytes)")
            try:
                self.sock.settimeout(left)
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


class FrameListener:
    """A worker's Unix-socket endpoint: each connection's frames, parsed by `parse`, are answered by
    `serve` (a generator of reply messages) on the connection's own thread."""

    def __init__(self, parse: Callable[[bytes], Any], serve: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
        self.parse = parse
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
        def requests() -> Iterator[Any]:
            while True:
                try:
                    frame = link.recv()
                except LinkClosed:
                    return
                yield self.parse(frame)

        try:
            for reply in self.serve(requests()):
                link.send(reply.SerializeToString())
        except LinkClosed:
            pass
        finally:
            link.close()

    def close(self) -> None:
        """Stop accepting connections (shutdown wakes the thread blocked in accept)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class StepLink(Protocol):
    """The scheduler's end of a link to one rank."""

    def send(self, request: wpb.StepRequest, timeout: float | None = None) -> int:
        """Send a request (TimeoutError if the rank takes none for `timeout` s); returns its size in bytes."""
        ...

    def recv(self, timeout: float) -> tuple[wpb.TargetOutput, int]:
        """The next reply and its size; TimeoutError after `timeout` s, LinkClosed when the rank is gone."""
        ...

    def close(self) -> None:
        """Release the link."""
        ...


Reply = TypeVar("Reply")


class FrameLink(Generic[Reply]):
    """The calling end of a `FrameListener` on this node: protobuf requests out, `parse`d replies back."""

    def __init__(self, name: str, parse: Callable[[bytes], Reply]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + name)
        self.frames = FrameSocket(sock)
        self.parse = parse

    def send(self, request: Any, timeout: float | None = None) -> int:
        """Send a request within `timeout` seconds; returns its size in bytes."""
        data = request.SerializeToString()
        self.frames.send(data, timeout)
        return len(data)

    def recv(self, timeout: float) -> tuple[Reply, int]:
        """The next reply and its size."""
        data = self.frames.recv(timeout)
        return self.parse(data), len(data)

    def close(self) -> None:
        """Close the socket (a rank drops the step it launched for it)."""
        self.frames.close()


def step_listener(serve: Callable[[Iterator[wpb.StepRequest]], Iterator[wpb.TargetOutput]]) -> FrameListener:
    """A target rank's endpoint for the scheduler's steps."""
    return FrameListener(wpb.StepRequest.FromString, serve)


def socket_link(name: str) -> FrameLink[wpb.TargetOutput]:
    """The scheduler's link to a rank's Unix socket (same node)."""
    return FrameLink(name, wpb.TargetOutput.FromString)


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

    def send(self, request: wpb.StepRequest, timeout: float | None = None) -> int:
        """Queue a request on the stream (never blocks); returns its size in bytes."""
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


def draft_listener(serve: Callable[[Iterator[wpb.DraftInputs]], Iterator[wpb.DraftOutputs]]) -> FrameListener:
    """A separate draft worker's endpoint for rank 0's draft steps."""
    return FrameListener(wpb.DraftInputs.FromString, serve)


def draft_link(name: str) -> FrameLink[wpb.DraftOutputs]:
    """Rank 0's link to a draft worker's Unix socket (same node)."""
    return FrameLink(name, wpb.DraftOutputs.FromString)


def connect(address: str, socket_name: str, same_node: bool) -> StepLink:
    """The fastest link to a rank: its Unix socket on this node, else the gRPC stream at `address`."""
    if same_node and socket_name:
        return socket_link(socket_name)
    return GrpcStreamLink(address)
