"""Property-based fuzzing of the internal step messages: StepPlan to a target worker, DraftInputs to a draft
worker, each served in this process over real gRPC on loopback.

Every call gets OK or INVALID_ARGUMENT naming the mutated field; after each one the worker still runs a
valid step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpserve.proto.codec import encode_tensor
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.convert import target_output_from_proto
from mtpserve.workers.draft_worker import DraftWorker
from mtpserve.workers.grpc_util import channel_options
from mtpserve.workers.target_worker import TargetWorker
from tests.helpers.tiny import save_mimic

K = 3
BLOCK = 8
NUM_BLOCKS = 64
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 600))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=1500)
int_lists = st.lists(ints, max_size=700)
tensors = st.builds(
    lambda dtype, shape, n: wpb.Tensor(dtype=dtype, shape=shape, data=bytes(n)),
    st.sampled_from(["FP32", "BF16", "INT64", "INT32", "BOOL", "FP8", ""]),
    st.lists(st.integers(-2, 70), max_size=3),
    st.integers(0, 5000),
)


@pytest.fixture(scope="module")
def cfg_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny CPU model with a draft head, as the worker actors get it."""
    path, head = save_mimic(tmp_path_factory.mktemp("fuzzmodel"))
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": path, "device": "cpu", "dtype": "float32"},
            "scheduler": {"num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK, "max_num_requests": 8},
            "speculative": {"draft": head, "num_draft_tokens": K},
        }
    )
    return cfg.model_dump_json()


@pytest.fixture(scope="module")
def target(cfg_json: str) -> Iterator[wpb_grpc.TargetWorkerStub]:
    """Rank 0 of a 1-rank group with the draft in process, and a stub on its gRPC port."""
    worker = TargetWorker(cfg_json, 0, 1)
    worker.setup(worker.master_address(), None)
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}", channel_options()) as ch:
        yield wpb_grpc.TargetWorkerStub(ch)
    worker.stop()


@pytest.fixture(scope="module")
def draft(cfg_json: str) -> Iterator[wpb_grpc.DraftWorkerStub]:
    """A draft worker and a stub on its gRPC port."""
    worker = DraftWorker(cfg_json)
    worker.setup()
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}", channel_options()) as ch:
        yield wpb_grpc.DraftWorkerStub(ch)
    worker.stop()


def valid_plan() -> wpb.StepPlan:
    """A final 8-token prompt chunk and a K=3 generation row of another request."""
    ctx = wpb.SeqPlan(
        request_id="a", token_ids=list(range(5, 13)), start=0, block_ids=[0, 1], is_context=True,
        is_final_chunk=True, lookahead_token=-1, top_p=1.0,
    )  # fmt: skip
    gen = wpb.SeqPlan(
        request_id="b", token_ids=[7, 8, 9, 10], start=5, block_ids=[2, 3], is_context=False, is_final_chunk=True,
        lookahead_token=-1, num_draft_tokens=K, temperature=0.7, top_p=0.9, seed=3,
    )  # fmt: skip
    return wpb.StepPlan(step_id=1, seqs=[ctx, gen], num_draft_tokens=K)


def valid_draft_inputs() -> wpb.DraftInputs:
    """One final 8-token prompt chunk's rows."""
    return wpb.DraftInputs(
        step_id=1, request_ids=["a"], token_ids=encode_tensor(torch.arange(5, 13)),
        positions=encode_tensor(torch.arange(8)), seq_lens=[8], is_context=[True],
        lookahead_tokens=encode_tensor(torch.tensor([-1])), sampled_tokens=encode_tensor(torch.tensor([20])),
        hidden_states=encode_tensor(torch.randn(8, 64)), block_ids=[wpb.BlockTable(ids=[0, 1])], propose=[True],
        temperature=[0.0], top_p=[1.0], top_k=[0], seed=[wpb.OptionalSeed()], num_draft_tokens=K,
        lookahead_source="prompt",
    )  # fmt: skip


def set_field(msg: Any, path: str, value: Any) -> None:
    """Set `path` (dotted, `seqs.0.start`) of a protobuf message to `value` (lists replace repeated fields)."""
    *parents, name = path.split(".")
    for p in parents:
        msg = msg[int(p)] if p.isdigit() else getattr(msg, p)
    field = getattr(msg, name)
    if isinstance(value, list):
        del field[:]
        field.extend(value)
    elif isinstance(value, wpb.Tensor):
        field.CopyFrom(value)
    else:
        setattr(msg, name, value)


PLAN_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "step_id": ints,
    "num_draft_tokens": st.integers(-(2**31), 2**31 - 1),
    "finished_request_ids": st.lists(texts, max_size=50),
    "seqs.0.request_id": texts,
    "seqs.0.token_ids": int_lists,
    "seqs.0.start": ints,
    "seqs.0.block_ids": int_lists,
    "seqs.0.is_context": st.booleans(),
    "seqs.0.is_final_chunk": st.booleans(),
    "seqs.0.lookahead_token": ints,
    "seqs.0.num_draft_tokens": st.integers(-(2**31), 2**31 - 1),
    "seqs.1.temperature": floats,
    "seqs.1.top_p": floats,
    "seqs.1.top_k": st.integers(-(2**31), 2**31 - 1),
    "seqs.1.seed": ints,
    "seqs.1.token_ids": int_lists,
    "seqs.1.start": ints,
    "seqs.1.draft_probs": tensors,
    "seqs.1.request_id": st.sampled_from(["a", "", "b"]),
}
DRAFT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "request_ids": st.lists(texts, max_size=20),
    "token_ids": tensors,
    "positions": tensors,
    "seq_lens": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    "is_context": st.lists(st.booleans(), max_size=20),
    "lookahead_tokens": tensors,
    "sampled_tokens": tensors,
    "hidden_states": tensors,
    "propose": st.lists(st.booleans(), max_size=20),
    "temperature": st.lists(floats, max_size=20),
    "top_p": st.lists(floats, max_size=20),
    "top_k": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    "num_draft_tokens": st.integers(-(2**31), 2**31 - 1),
    "lookahead_source": texts,
}


def mutation(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[tuple[str, Any]]:
    """A field path and a value for it."""
    return st.sampled_from(sorted(fields)).flatmap(lambda f: st.tuples(st.just(f), fields[f]))


def call_mutated(call: Callable[..., Any], valid: Callable[[], Any], message: str, change: tuple[str, Any]) -> None:
    """Call with a valid message whose field `change[0]` is set to `change[1]`: the answer is OK or
    INVALID_ARGUMENT whose details name the message and the field. Values protobuf itself refuses (e.g. a
    non-UTF-8 string) are skipped."""
    path, value = change
    msg = valid()
    try:
        set_field(msg, path, value)
    except (ValueError, TypeError):
        return
    try:
        call(msg, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, exc.code(), exc.details())
        details = exc.details() or ""
        top = path.split(".")[0]
        assert details.startswith(f"{message}.") and (top in details or "tensor" in details), (path, details)


@FUZZ
@given(change=mutation(PLAN_FIELDS))
def test_fuzzed_step_plans_get_ok_or_invalid_argument(
    target: wpb_grpc.TargetWorkerStub, change: tuple[str, Any]
) -> None:
    call_mutated(target.Execute, valid_plan, "StepPlan", change)
    out = target_output_from_proto(target.Execute(valid_plan(), timeout=60))
    assert [len(r.new_token_ids) for r in out.results] and len(out.results) == 2


@FUZZ
@given(change=mutation(DRAFT_FIELDS))
def test_fuzzed_draft_inputs_get_ok_or_invalid_argument(
    draft: wpb_grpc.DraftWorkerStub, change: tuple[str, Any]
) -> None:
    call_mutated(draft.Propose, valid_draft_inputs, "DraftInputs", change)
    out = draft.Propose(valid_draft_inputs(), timeout=60)
    assert list(out.request_ids) == ["a"] and list(out.draft_token_ids.shape) == [1, K]


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("seqs.0.block_ids", [0, NUM_BLOCKS], f"StepPlan.seqs[0].block_ids[1]: {NUM_BLOCKS} is out of range"),
        ("seqs.0.block_ids", [0], "StepPlan.seqs[0].block_ids: 1 blocks of 8 hold fewer than 11 slots"),
        ("seqs.0.token_ids", [5, 96], "StepPlan.seqs[0].token_ids[1]: 96 is out of range [0, 96)"),
        ("seqs.1.start", 512, f"StepPlan.seqs[1].start: rows [512, 516) leave [0, {512 + K})"),
        ("seqs.1.top_p", math.nan, "StepPlan.seqs[1].top_p: nan is not in (0, 1]"),
        ("seqs.1.request_id", "a", "StepPlan.seqs.request_id[1]: repeats request id 'a'"),
        ("num_draft_tokens", K + 1, f"StepPlan.num_draft_tokens: {K + 1} is not in [0, {K}]"),
        ("seqs.1.draft_parents", [0, 0], "StepPlan.seqs[1].draft_parents: has 2 entries for 3 drafts"),
        ("seqs.1.draft_parents", [0, 2, 1], "StepPlan.seqs[1].draft_parents[1]: 2 is not in [0, 1]"),
        ("seqs.1.token_ids", [7, 8, 8, 10], "StepPlan.seqs[1].draft_parents[1]: repeats token 8 among the children"),
        (
            "seqs.1.draft_probs",
            encode_tensor(torch.full((K, 96), math.nan)),
            "StepPlan.seqs[1].draft_probs: must be probabilities in [0, 1]",
        ),
    ],
)
def test_bad_plans_name_field_and_reason(target: wpb_grpc.TargetWorkerStub, path: str, value: Any, needle: str) -> None:
    plan = valid_plan()
    if "draft_parents" in needle:
        set_field(plan, "seqs.1.draft_parents", [0, 0, 1])
    set_field(plan, path, value)
    with pytest.raises(grpc.RpcError) as err:
        target.Execute(plan, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(needle), err.value.details()


def test_the_valid_messages_run(target: wpb_grpc.TargetWorkerStub, draft: wpb_grpc.DraftWorkerStub) -> None:
    out = target.Execute(valid_plan(), timeout=60)
    assert len(target_output_from_proto(out).results[0].new_token_ids) == 1
    assert out.draft_outputs.request_ids == ["a", "b"]
    tree = valid_plan()
    set_field(tree, "seqs.1.draft_parents", [0, 0, 1])  # two candidates after the last token, one below the first
    out = target_output_from_proto(target.Execute(tree, timeout=60))
    assert 1 <= len(out.results[1].new_token_ids) <= 3
    assert list(draft.Propose(valid_draft_inputs(), timeout=60).draft_token_ids.shape) == [1, K]


def test_limits_follow_the_worker_build() -> None:
    from mtpserve.workers.target_worker import step_limits

    cfg = MTPServeConfig.from_dict({"scheduler": {"block_size": 4, "max_num_requests": 3}})
    lim = step_limits(cfg, 100, 32, 10, max_len=77, k=2)
    assert (lim.block_size, lim.max_num_requests, lim.num_blocks, lim.max_model_len, lim.num_draft_tokens) == (
        4, 3, 10, 77, 2,
    )  # fmt: skip
