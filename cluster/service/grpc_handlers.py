"""The Inference service's method handlers, with request parsing that answers a malformed message (bytes that are
no protobuf of the request's type, or a string field that is not UTF-8) with INVALID_ARGUMENT naming the request
type, instead of gRPC's UNKNOWN with a Python class name and a logged traceback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]


class Malformed:
    """What a request that did not parse arrives as."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def parser(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """`cls.FromString`, returning Malformed where it raises."""

    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError:
            return Malformed(cls.DESCRIPTOR.full_name)

    return parse


async def refuse(request: Malformed, context: grpc.aio.ServicerContext) -> None:
    """End the call with INVALID_ARGUMENT naming the request type."""
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request: not a valid {request.type_name} (malformed protobuf, or a string field that is not UTF-8)",
    )


def unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A unary method that refuses a malformed request."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await refuse(request, context)
        return await fn(request, context)

    return call


def streaming(fn: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A server-streaming method that refuses a malformed request."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await refuse(request, context)
        async for reply in fn(request, context):
            yield reply

    return call


def add_inference_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register `servicer`'s methods of mtpserve.v1.Inference on `server`."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        fn = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            streaming(fn) if method.server_streaming else unary(fn),
            request_deserializer=parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
