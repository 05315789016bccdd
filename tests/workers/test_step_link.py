"""The scheduler's step link to a target rank, without Ray: a real TargetWorker in this process, served
over its Unix socket and over the gRPC stream, driven by the distributed engine's RemoteTarget.

Steps the rank can queue ahead go as LAUNCH / LAUNCH_AFTER / COLLECT (the rank runs its fixed-buffer steps
eagerly on CPU, as CUDA replays them), the rest as EXECUTE; the tokens equal the in-process engine's.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from mtpserve.cluster.distributed.actors import RemoteTarget, engine_over
from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.speculative.mtp_chain import MTPEagleChain
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.launch_spec import LaunchSpec
from mtpserve.workers.step_link import FrameSocket, StepLink, connect, socket_link
from mtpserve.workers.target_worker import TargetWorker
from mtpserve.workers.tree_step import FusedTreeStep
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.tiny import mimic_target, random_prompts, rebuilt, save_mimic
from tests.workers.test_overlap import PARAMS, drive

K = 3


class LocalRank:
    """A one-rank group served in this process: what `WorkerGroup` hands `RemoteTarget` (config, links,
    launch spec), without Ray. The rank gets the fixed-buffer steps CUDA would capture, run eagerly."""

    def __init__(self, cfg: MTPServeConfig, transport: str) -> None:
        self.cfg = cfg
        self.worker = TargetWorker(cfg.model_dump_json(), 0, 1)
        self.worker.setup(self.worker.master_address(), None)
        runner = self.worker.runner
        assert runner is not None
        fixed = {"max_batch": 8, "max_blocks": 12, "device": "cpu", "use_graphs": False}  # CUDA's buffers, eagerly
        model, cache, draft = runner.model, runner.cache, self.worker.draft
        if isinstance(draft, MTPEagleTree):
            runner = rebuilt(runner, tree=FusedTreeStep(model, cache, draft, **fixed))
        elif isinstance(draft, MTPEagleChain):
            runner = rebuilt(runner, chain=FusedSpecStep(model, cache, draft, K, **fixed))
        else:
            runner = rebuilt(runner, target=UniformTargetStep(model, cache, 1, **fixed))
        self.worker.runner = runner
        self.spec: LaunchSpec | None = self.worker.launch_spec()
        self.step_costs = None
        address, name, _ = self.worker.endpoint()
        self.links: list[StepLink] = [connect(address, name, same_node=transport == "socket")]
        self.launches = 0
        self.launches_after = 0  # of those, steps whose inputs came from the step before on the device
        launch = runner.launch

        def counted(plan, after=None):  # type: ignore[no-untyped-def]
            self.launches += 1
            self.launches_after += after is not None
            return launch(plan, after)

        runner.launch = counted  # type: ignore[method-assign]

    def stop(self) -> None:
        """Close the link and the worker's servers."""
        for link in self.links:
            link.close()
        self.worker.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return save_mimic(tmp_path_factory.mktemp("linkmodel"))


def config(
    model: tuple[str, str], k: int, tree: bool = False, max_model_len: int | None = None, steps_ahead: int | None = None
) -> MTPServeConfig:
    spec: dict[str, Any] = {"draft": model[1], "num_draft_tokens": K, "enabled": k > 0, "adaptive": False}
    if tree:
        spec.update(tree_budget=8, tree_width=3)
    return MTPServeConfig.from_dict(
        {
            "model": {
                "path": model[0],
                "device": "cpu",
                "dtype": "float32",
                "max_model_len": max_model_len,
                "steps_ahead": steps_ahead,
            },
            "scheduler": {"num_kv_blocks": 96, "block_size": 8, "max_num_requests": 8},
            "speculative": spec,
        }
    )


@pytest.fixture
def rank(request: pytest.FixtureRequest, model: tuple[str, str]) -> Iterator[LocalRank]:
    k, transport = request.param
    r = LocalRank(config(model, k), transport)
    yield r
    r.stop()


@pytest.mark.parametrize(
    "rank", [(0, "socket"), (K, "socket"), (0, "grpc"), (K, "grpc")], indirect=True, ids=lambda p: f"k{p[0]}-{p[1]}"
)
def test_remote_steps_match_the_in_process_engine(rank: LocalRank, model: tuple[str, str]) -> None:
    """Greedy and seeded sampling requests, a late arrival and an abort through the step link: the same
    tokens and finish reasons as the in-process engine, most decode steps launched ahead on the rank, every
    KV block returned."""
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [21, 5, 13, 9], seed=11)
    params = [dict(p) for p in PARAMS]
    want = drive(LLMEngine.from_config(rank.cfg, load_tokenizer=False), prompts, params)
    eng = engine_over(rank.cfg, rank)
    got = drive(eng, prompts, params)
    assert got["tokens"] == want["tokens"] and got["reasons"] == want["reasons"]
    assert got["blocks_held"] == 0
    hops = eng.target.hops  # type: ignore[attr-defined]
    assert rank.launches > hops["steps"] / 2, "most decode steps must be launched ahead"
    assert hops["worker_s"] > 0 and hops["output_bytes"] > 0


def test_tree_steps_queue_ahead_on_a_rank_drafting_in_process(model: tuple[str, str]) -> None:
    """A TP=1 rank with its tree drafter in process (the tree step CUDA captures, run eagerly): a late arrival
    and an abort through the step link give the in-process engine's tokens, most tree steps go LAUNCH_AFTER
    (their placeholder trees pass the rank's checks), every KV block comes back; a LAUNCH_AFTER of another
    draft count than the launched step is refused by name."""
    r = LocalRank(config(model, K, tree=True), "socket")
    try:
        args, _ = mimic_target()
        prompts = random_prompts(4, args.vocab_size, [21, 5, 13, 9], seed=11)
        params: list[dict[str, Any]] = [{"max_tokens": m} for m in (24, 9, 40, 16)]
        want = drive(LLMEngine.from_config(r.cfg, load_tokenizer=False), prompts, params)
        eng = engine_over(r.cfg, r)
        got = drive(eng, prompts, params)
        assert got["tokens"] == want["tokens"] and got["reasons"] == want["reasons"]
        assert got["blocks_held"] == 0 and want["acceptance"] > 0
        assert r.launches_after >= 5 and r.launches_after > eng.target.hops["steps"] / 2  # type: ignore[attr-defined]
        rid = eng.add_request([1, 2, 3], {"max_tokens": 20})
        for _ in range(4):  # the aborted request's launched step is read first, then the prompt, then trees
            eng.step()
        plan = eng._launched[-1].plan
        assert [s.request_id for s in plan.seqs] == [rid]
        assert plan.num_draft_tokens == 8 and plan.seqs[0].draft_parents is not None
        r.links[0].close()
        from mtpserve.workers.convert import plan_to_proto

        link = socket_link(r.worker.endpoint()[1])
        first = wpb.StepRequest(kind=wpb.StepRequest.LAUNCH, plan=plan_to_proto(plan, columns=False))
        first.plan.seqs[0].token_ids[0] = 1
        link.send(first)
        chain = wpb.StepRequest(kind=wpb.StepRequest.LAUNCH_AFTER, plan=plan_to_proto(plan, columns=False))
        chain.plan.num_draft_tokens = chain.plan.seqs[0].num_draft_tokens = K
        del chain.plan.seqs[0].token_ids[K + 1 :]
        del chain.plan.seqs[0].draft_parents[:]
        link.send(chain)
        reply, _ = link.recv(10.0)
        assert reply.error.code == "INVALID_ARGUMENT" and "num_draft_tokens" in reply.error.message, reply
        link.close()
        r.links = []
    finally:
        r.stop()


def recorded_requests(r: LocalRank, prompts: list[list[int]]) -> list[wpb.StepRequest]:
    """The step requests a distributed engine sends r's rank while it generates for `prompts` (the link is
    closed afterwards)."""
    sent: list[wpb.StepRequest] = []
    send = r.links[0].send

    def recorded(req: wpb.StepRequest, timeout: float | None = None) -> int:
        sent.append(wpb.StepRequest.FromString(req.SerializeToString()))
        return send(req, timeout)

    r.links[0].send = recorded  # type: ignore[method-assign]
    engine_over(r.cfg, r).generate(prompts, {"max_tokens": 10})
    r.links[0].close()
    r.links = []
    return sent


def replay_session(r: LocalRank, requests: list[wpb.StepRequest]) -> tuple[list[list[tuple[str, int]]], list[bytes]]:
    """Feed recorded step requests to a fresh session of r's rank, one at a time as a link would; returns, per
    request, the order of its launches and replies by step id, and the replies."""
    runner = r.worker.runner
    assert runner is not None
    events: list[list[tuple[str, int]]] = []
    launch = runner.launch

    def ordered(plan, after=None):  # type: ignore[no-untyped-def]
        events[-1].append(("launch", plan.step_id))
        return launch(plan, after)

    runner.launch = ordered  # type: ignore[method-assign]
    session, replies = r.worker._session(), []
    for req in requests:
        events.append([])
        for reply in session.handle(req):
            events[-1].append(("reply", reply.step_id))
            reply.ClearField("timing")
            replies.append(reply.SerializeToString())
    assert not session.failed
    runner.launch = launch  # type: ignore[method-assign]
    return events, replies


def expected_replies(requests: list[wpb.StepRequest]) -> list[list[int]]:
    """The step ids each request should release, from the protocol: a LAUNCH leaves `unanswered` launched
    steps (its own included) unanswered, a COLLECT answers the oldest, an EXECUTE answers all, then itself."""
    pending: list[int] = []
    out: list[list[int]] = []
    for q in requests:
        if q.kind == wpb.StepRequest.COLLECT:
            out.append([pending.pop(0)])
        elif q.kind == wpb.StepRequest.EXECUTE:
            out.append([*pending, q.plan.step_id])
            pending = []
        else:
            pending.append(q.plan.step_id)
            keep = max(1, q.unanswered)
            out.append(pending[: len(pending) - keep])
            pending = pending[len(pending) - keep :]
    return out


@pytest.mark.parametrize("ahead", [1, 2])
def test_launched_steps_are_answered_in_order_and_early_when_finished(
    model: tuple[str, str], monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    """With 1 or 2 steps launched ahead, each message releases the replies the protocol says (the launched
    steps past `unanswered`, oldest first). When the device has finished such a step by the time a LAUNCH
    arrives, the rank answers it before queueing the new step (the scheduler plans meanwhile); while the
    device still runs it, the new step is launched first. Both orders give the same replies."""
    from mtpserve.workers.step_session import StepSession

    for k in (0, K):
        r = LocalRank(config(model, k, steps_ahead=ahead), "socket")
        try:
            sent = recorded_requests(r, [[1, 2, 3, 4, 5], [7, 8, 9]])
            launches = [
                i for i, q in enumerate(sent) if q.kind in (wpb.StepRequest.LAUNCH, wpb.StepRequest.LAUNCH_AFTER)
            ]
            assert {sent[i].unanswered for i in launches} == {ahead}
            want = expected_replies(sent)
            releasing = [i for i in launches if want[i]]
            assert len(releasing) >= 3
            assert sum(len(w) for w in want) == sum(q.kind != wpb.StepRequest.COLLECT for q in sent)
            early, early_replies = replay_session(r, sent)  # CPU steps are finished once launched
            with monkeypatch.context() as m:
                m.setattr(StepSession, "_finished", staticmethod(lambda launched: False))
                late, late_replies = replay_session(r, sent)
            for events in (early, late):
                assert [[i for e, i in ev if e == "reply"] for ev in events] == want, (k, ahead)
            for i in releasing:
                step = sent[i].plan.step_id
                assert early[i][-1] == ("launch", step) and late[i][0] == ("launch", step), (k, ahead, i)
            assert late_replies == early_replies
        finally:
            r.stop()


def test_a_bad_message_gets_invalid_argument_and_the_rank_serves_on(model: tuple[str, str]) -> None:
    """A plan naming a block outside the cache gets a StepError naming the field; the stream ends, and the
    next connection runs a valid step."""
    r = LocalRank(config(model, K), "socket")
    try:
        bad = wpb.StepRequest(kind=wpb.StepRequest.EXECUTE)
        seq = bad.plan.seqs.add(request_id="x", token_ids=[1, 2, 3], start=0, block_ids=[10_000], is_context=True)
        seq.lookahead_token = -1
        seq.is_final_chunk = True
        r.links[0].send(bad)
        reply, _ = r.links[0].recv(10.0)
        assert reply.error.code == "INVALID_ARGUMENT" and "block_ids" in reply.error.message
        r.links[0].close()
        _, name, _ = r.worker.endpoint()
        r.links = [socket_link(name)]
        eng = engine_over(r.cfg, r)
        out = eng.generate([[1, 2, 3, 4]], {"max_tokens": 5})[0]
        assert len(out.token_ids) == 5
    finally:
        r.stop()


def test_a_stalled_link_times_out_and_a_closed_one_fails() -> None:
    """No reply within the timeout raises TimeoutError; the other end closing raises LinkClosed (which
    RemoteTarget reports as an unavailable worker)."""
    from mtpserve.workers.step_link import LinkClosed

    a, b = socket.socketpair()
    ends = FrameSocket(a), FrameSocket(b)
    ends[0].send(b"hello")
    assert ends[1].recv(1.0) == b"hello"
    with pytest.raises(TimeoutError):
        ends[1].recv(0.05)
    ends[0].close()
    with pytest.raises(LinkClosed):
        ends[1].recv(1.0)
    assert issubclass(LinkClosed, ConnectionError) and not issubclass(WorkerUnavailableError, LinkClosed)


def test_a_broken_link_fails_the_step_as_unavailable(model: tuple[str, str]) -> None:
    """The step link breaking mid-run fails the next step with WorkerUnavailableError and marks the target
    unhealthy (a rank killed on Ray, and the restart that follows, are covered in test_distributed)."""
    r = LocalRank(config(model, 0), "socket")
    eng = engine_over(r.cfg, r)
    target = eng.target
    assert isinstance(target, RemoteTarget)
    target._recover = lambda: None  # type: ignore[method-assign]  # no Ray here to restart anything
    eng.add_request([1, 2, 3], {"max_tokens": 50})
    eng.step()
    r.stop()
    with pytest.raises(WorkerUnavailableError, match="worker"):
        for _ in range(5):
            eng.step()
    assert not target.healthy


@pytest.mark.parametrize("k", [0, K])
def test_a_step_that_raises_leaves_no_reply_behind(model: tuple[str, str], k: int) -> None:
    """An engine step that raises after its next step was queued on the rank (here the scheduler's update,
    once): the launched step's reply is read and dropped, so the next request's steps get their own replies
    and the in-process engine's tokens, and the target stays healthy."""
    r = LocalRank(config(model, k), "socket")
    try:
        eng = engine_over(r.cfg, r)
        prompt = [5, 9, 2, 7, 1]
        want = LLMEngine.from_config(r.cfg, load_tokenizer=False).generate([prompt], {"max_tokens": 12})[0].token_ids
        rid = eng.add_request([3, 1, 4, 1, 5], {"max_tokens": 40})
        for _ in range(4):
            eng.step()
        assert eng._launched, "a step must be queued on the rank when update raises"
        update = eng.scheduler.update

        def broken(*a, **kw):  # type: ignore[no-untyped-def]
            eng.scheduler.update = update  # type: ignore[method-assign]
            raise RuntimeError("injected")

        eng.scheduler.update = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        eng.abort(rid)  # what EngineLoop does with the failed step's requests
        assert eng.generate([prompt], {"max_tokens": 12})[0].token_ids == want
        assert eng.target.healthy  # type: ignore[attr-defined]
    finally:
        r.stop()


def test_out_of_order_messages_are_refused(model: tuple[str, str]) -> None:
    """COLLECT or LAUNCH_AFTER with no launched step, a LAUNCH_AFTER row past the launched step's rows, and a
    LAUNCH leaving more steps unanswered than a rank can hold are refused by name instead of answering garbage
    or nothing."""
    r = LocalRank(config(model, 0), "socket")
    try:
        _, name, _ = r.worker.endpoint()
        link = r.links[0]
        link.send(wpb.StepRequest(kind=wpb.StepRequest.COLLECT))
        reply, _ = link.recv(10.0)
        assert reply.error.code == "FAILED_PRECONDITION" and "COLLECT" in reply.error.message
        link.close()
        r.links = [socket_link(name)]
        eng = engine_over(r.cfg, r)
        eng.add_request([1, 2, 3], {"max_tokens": 20})
        eng.step()
        eng.step()
        plan = eng._launched[-1].plan
        r.links[0].close()
        from mtpserve.workers.convert import plan_to_proto

        for pending, row, code in ((False, 0, "FAILED_PRECONDITION"), (True, 5, "INVALID_ARGUMENT")):
            link = socket_link(name)
            if pending:
                first = wpb.StepRequest(kind=wpb.StepRequest.LAUNCH, plan=plan_to_proto(plan, columns=False))
                first.plan.seqs[0].token_ids[0] = 1
                link.send(first)
            bad = wpb.StepRequest(kind=wpb.StepRequest.LAUNCH_AFTER, plan=plan_to_proto(plan, columns=False))
            bad.plan.seqs[0].token_ids[0] = row
            link.send(bad)
            reply, _ = link.recv(10.0)
            assert reply.error.code == code, reply
            link.close()
        link = socket_link(name)  # more steps left unanswered than a rank has host buffers for
        too_many = wpb.StepRequest(kind=wpb.StepRequest.LAUNCH, plan=plan_to_proto(plan, columns=False), unanswered=3)
        too_many.plan.seqs[0].token_ids[0] = 1
        link.send(too_many)
        reply, _ = link.recv(10.0)
        assert reply.error.code == "INVALID_ARGUMENT" and "StepRequest.unanswered" in reply.error.message, reply
        link.close()
    finally:
        r.stop()


def test_a_closed_listener_accepts_no_more_connections() -> None:
    """After close, connecting to the listener's name fails."""
    from mtpserve.workers.step_link import FrameListener

    listener = FrameListener(wpb.StepRequest.FromString, lambda requests: iter(()))
    socket_link(listener.name).close()
    listener.close()
    with pytest.raises(OSError):
        socket_link(listener.name)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_requests_reach_max_model_len_through_the_link(model: tuple[str, str], tree: bool) -> None:
    """Requests that run into max_model_len while drafting: their last steps draft rows past the limit (the
    output is cut there), which the rank runs as the in-process engine does; same tokens, finish reason
    'length', every block back."""
    r = LocalRank(config(model, K, tree=tree, max_model_len=48), "socket")
    try:
        args, _ = mimic_target()
        prompts = random_prompts(4, args.vocab_size, [30, 21, 40, 35], seed=5)
        params: list[dict[str, Any]] = [{"max_tokens": 100, "ignore_eos": True} for _ in prompts]
        want = drive(LLMEngine.from_config(r.cfg, load_tokenizer=False), prompts, params)
        assert [want["reasons"][f"r{i}"] for i in (0, 1, 3)] == ["length"] * 3  # r2 is aborted by `drive`
        eng = engine_over(r.cfg, r)
        got = drive(eng, prompts, params)
        assert got["tokens"] == want["tokens"] and got["reasons"] == want["reasons"]
        assert got["blocks_held"] == 0
    finally:
        r.stop()
