"""Property-based fuzzing of the public gRPC API and the worker step messages (hypothesis).

Every public call must end OK (a complete stream) or INVALID_ARGUMENT naming the field at fault; the
server keeps serving and no KV block stays held. Tensors in the worker step messages must decode to
exactly what they state or be refused with an error that names the field.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.server import MTPServer
from mtpserve.proto.codec import decode_tensor, encode_tensor
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import write_tiny_model

INT32 = st.integers(-(2**31), 2**31 - 1)
FIELDS = re.compile(r"^(prompt(\.text|\.token_ids)?|request_id|sampling\.\w+): ")
OUTCOMES: Counter[str] = Counter()  # what the API fuzzing saw, checked by the test after it
SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MTPServer, MTPServeClient]]:
    """A speculative tiny-model server with SmolLM2's tokenizer (so text prompts are real), and a client."""
    model, head = write_tiny_model(tmp_path_factory.mktemp("fuzz-model"))
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "device": "cpu", "dtype": "float32"},
            "speculative": {"draft": str(head), "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 128, "max_num_requests": 4, "max_queue": 4},
            "server": {"port": 0, "metrics_port": 0},
        }
    )
    srv = MTPServer(LLMEngine.from_config(cfg), metrics=False)
    srv.start()
    with MTPServeClient(f"127.0.0.1:{srv.port}", timeout=60) as client:
        yield srv, client
    srv.stop()


def sampling() -> st.SearchStrategy[pb.SamplingParams]:
    """Sampling fields anywhere in their wire ranges (NaN and infinities too), each possibly unset."""
    floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-2, 3)
    small = st.integers(-3, 12) | INT32

    @st.composite
    def build(draw: Any) -> pb.SamplingParams:
        msg = pb.SamplingParams(ignore_eos=draw(st.booleans()))
        for name, strat in (("max_tokens", small), ("temperature", floats), ("top_p", floats), ("top_k", small)):
            if draw(st.booleans()):
                setattr(msg, name, draw(strat))
        if draw(st.booleans()):
            msg.seed = draw(st.integers(-(2**63), 2**63 - 1))
        msg.stop_token_ids.extend(draw(st.lists(st.integers(-5, 60000) | INT32, max_size=40)))
        return msg

    return build()


def requests() -> st.SearchStrategy[pb.GenerateRequest]:
    """Requests with text (any unicode), token ids (in and out of range, many) or no prompt at all."""
    ids = st.lists(st.integers(-3, 49160) | INT32, max_size=600)

    @st.composite
    def build(draw: Any) -> pb.GenerateRequest:
        req = pb.GenerateRequest(request_id=draw(st.text(max_size=300)), raw=draw(st.booleans()))
        kind = draw(st.sampled_from(["text", "ids", "none"]))
        if kind == "text":
            req.text = draw(st.text(max_size=400))
        elif kind == "ids":
            req.token_ids.ids.extend(draw(ids))
        if draw(st.booleans()):
            req.sampling.CopyFrom(draw(sampling()))
        return req

    return build()


def bounded(req: pb.GenerateRequest) -> pb.GenerateRequest:
    """The same request with max_tokens capped to keep each example fast (huge values are still tried)."""
    if req.sampling.HasField("max_tokens") and req.sampling.max_tokens > 24:
        req.sampling.max_tokens = 2**31 - 1 if req.sampling.max_tokens % 7 == 0 else 24
    return req


def _ok(**fields: Any) -> pb.GenerateRequest:
    """A valid request, so that every run streams some whatever the generated examples are."""
    sampling = fields.pop("sampling", {})
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)


@SETTINGS
@given(req=requests())
@example(req=_ok(token_ids=pb.TokenIds(ids=[3, 4, 5]), sampling={"max_tokens": 4, "ignore_eos": True}))
@example(req=_ok(text="Hello there", sampling={"max_tokens": 3}))
@example(req=_ok(text="x", raw=True, request_id="fixed-id", sampling={"max_tokens": 2, "temperature": 0.7, "seed": 5}))
@example(req=_ok(token_ids=pb.TokenIds(ids=[7] * 40), sampling={"top_k": 3, "top_p": 0.5, "stop_token_ids": [9]}))
@example(req=_ok(text="é ∑ 🙂", sampling={"max_tokens": 2**31 - 1 - 6}))
def test_public_api_answers_ok_or_names_the_field(served: tuple[MTPServer, MTPServeClient], req: Any) -> None:
    """A complete stream (final chunk, no more tokens than asked) or INVALID_ARGUMENT 'field: reason'."""
    _, client = served
    req = bounded(req)
    tokens, final = 0, None
    try:
        for msg in client.stub.Generate(req, timeout=60):
            tokens += len(msg.token_ids)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                final = msg
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert FIELDS.match(exc.details() or ""), exc.details()
        OUTCOMES["invalid"] += 1
        return
    OUTCOMES["ok"] += 1
    assert final is not None, "the stream ended without a final message"
    cap = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 64
    assert 0 < tokens <= cap and final.usage.completion_tokens == tokens
    for name in ("temperature", "top_p"):
        if req.sampling.HasField(name):
            assert math.isfinite(getattr(req.sampling, name)), f"non-finite {name} was accepted"


def test_server_still_serves_and_holds_no_blocks(served: tuple[MTPServer, MTPServeClient]) -> None:
    """After the fuzzing above (which must have seen both complete streams and refusals): SERVING, a normal
    request works, every KV block is free."""
    assert OUTCOMES["ok"] >= 10 and OUTCOMES["invalid"] >= 10, OUTCOMES
    srv, client = served
    assert client.health() == "SERVING"
    assert len(client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
    blocks = srv.engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def tensors() -> st.SearchStrategy[wpb.Tensor]:
    """Tensor messages with any dtype name, shape (negative and zero dims too) and payload."""
    names = st.sampled_from(["FP32", "BF16", "FP16", "INT64", "INT32", "BOOL"]) | st.text(max_size=6)

    @st.composite
    def build(draw: Any) -> wpb.Tensor:
        shape = draw(st.lists(st.integers(-3, 6), max_size=4))
        numel = math.prod(shape)
        size = draw(st.sampled_from([abs(numel) * 2, abs(numel) * 4, abs(numel) * 8, 0]) | st.integers(0, 64))
        return wpb.Tensor(dtype=draw(names), shape=shape, data=draw(st.binary(min_size=size, max_size=size)))

    return build()


@SETTINGS
@given(msg=tensors())
def test_tensor_messages_decode_or_fail_naming_the_field(msg: Any) -> None:
    """Hidden states and token tensors off the wire: a tensor of exactly the stated dtype and shape, or a
    ValueError that names dtype, shape or data."""
    try:
        t = decode_tensor(msg)
    except ValueError as exc:
        assert re.match(r"^tensor (dtype|shape|data)\b", str(exc)), str(exc)
        return
    assert tuple(t.shape) == tuple(msg.shape) and encode_tensor(t).data == msg.data
