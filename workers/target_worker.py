"""TargetWorker: one tensor-parallel rank (model shard, KV cache) serving StepPlans.

Run as a Ray actor (`cluster/distributed/actors.py`). Steps arrive on a long-lived link (`workers/step_link.py`: a
Unix socket on the scheduler's node, else the gRPC `Steps` stream; the unary `Execute` call serves
one-off steps). Rank 0 also forwards DraftInputs to the draft, either in its own process (colocated;
with TP=1 on CUDA the target's captured steps include it) or to the DraftWorker (separate: over its
draft link on this node, gRPC from another), and returns both results.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import torch

from mtpserve.modeling.loader import resolve_device, to_dtype
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from mtpserve.speculative.messages import TargetOutput
from mtpserve.speculative.methods import DraftMethod
from mtpserve.speculative.mtp_tree import MTPEagleTree
from mtpserve.workers.builders import (
    bind_features,
    build_configured_target,
    build_draft,
    build_shared,
    load_heads,
    load_target,
    max_model_len,
    num_blocks_for,
)
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.convert import draft_inputs_to_proto, draft_outputs_from_proto, target_output_to_proto
from mtpserve.workers.distributed import free_port, init_tp_group
from mtpserve.workers.fused_step import FusedDepthSteps
from mtpserve.workers.grpc_util import channel_options, node_ip, start_server
from mtpserve.workers.heap import freeze_startup_heap
from mtpserve.workers.launch_spec import LaunchSpec
from mtpserve.workers.message_checks import StepLimits
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.step_builders import TargetParts, build_chain_graphs, build_runner
from mtpserve.workers.step_link import FrameLink, LinkClosed, draft_link, step_listener
from mtpserve.workers.step_session import StepFailure, StepSession, decode_plan


def step_limits(
    cfg: MTPServeConfig, vocab_size: int, hidden_size: int, num_blocks: int, max_len: int, k: int
) -> StepLimits:
    """What a worker built from `cfg` can run."""
    sched = cfg.scheduler
    return StepLimits(
        num_blocks=num_blocks,
        block_size=sched.block_size,
        max_model_len=max_len,
        vocab_size=vocab_size,
        max_num_requests=sched.max_num_requests,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        num_draft_tokens=k,
        hidden_size=hidden_size,
        scratch_slots=cfg.speculative.scratch_slots if k else 0,
    )


def worker_device(cfg: MTPServeConfig) -> str:
    """The device a worker uses: Ray exposes one GPU per GPU actor as cuda:0."""
    dev = resolve_device(cfg.model.device)
    return "cuda:0" if dev == "cuda" else dev


class TargetWorker(wpb_grpc.TargetWorkerServicer):
    """One TP rank. `setup` joins the process group and loads the shard; `Execute` runs a step."""

    def __init__(self, cfg_json: str, rank: int, world: int) -> None:
        self.cfg = MTPServeConfig.model_validate_json(cfg_json)
        self.rank, self.world = rank, world
        self.device = worker_device(self.cfg)
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.runner: TargetRunner | None = None
        self.draft: DraftMethod | None = None
        self.draft_stub: wpb_grpc.DraftWorkerStub | None = None  # a draft worker on another node
        self.draft_link: FrameLink[wpb.DraftOutputs] | None = None  # a draft worker on this node
        self.limits: StepLimits | None = None
        self._lock = threading.Lock()
        self._server, self.port = start_server(lambda s: wpb_grpc.add_TargetWorkerServicer_to_server(self, s))
        self._listener = step_listener(self._serve_steps)

    def address(self) -> str:
        """host:port of this rank's gRPC server."""
        return f"{node_ip()}:{self.port}"

    def endpoint(self) -> tuple[str, str, str]:
        """(gRPC host:port, Unix socket name, node address) of this rank's step link."""
        return self.address(), self._listener.name, node_ip()

    def step_costs(self) -> dict[tuple[int, int], float] | None:
        """Seconds per (batch bucket, draft count) of this rank's fused depth steps and, adaptive over a tree,
        its tree step (keyed by the tree's budget), timed here once; None without fused depth steps."""
        runner = self.runner
        if runner is None or not isinstance(runner.steps.chain, FusedDepthSteps):
            return None
        costs = runner.steps.chain.time_steps()
        drafter, tree_step = self.draft, runner.steps.tree
        if isinstance(drafter, MTPEagleTree) and drafter.chains and tree_step is not None:
            costs.update({(bucket, drafter.budget): s for bucket, s in tree_step.time_steps().items()})
        return costs

    def launch_spec(self) -> LaunchSpec | None:
        """Which plans this rank's runner can queue ahead (`TargetRunner.launch`), for the scheduler."""
        return None if self.runner is None else self.runner.launch_spec()

    def master_address(self) -> str:
        """A fresh host:port for the process group's rendezvous (asked of rank 0)."""
        return f"{node_ip()}:{free_port()}"

    def setup(self, master: str, draft: tuple[str, str, str] | None) -> int:
        """Join the TP group, load this rank's shard and (rank 0) the draft, colocated or reached at the draft
        worker's `endpoint()` when given; returns the KV block count."""
        cfg = self.cfg
        tp = init_tp_group(self.rank, self.world, master, self.device)
        _, args, weights = load_target(cfg)
        dtype = to_dtype(cfg.model.dtype, self.device)
        model = build_configured_target(cfg, args, weights, dtype, device=self.device, tp=tp)
        max_len = max_model_len(cfg, args)
        num_blocks = num_blocks_for(cfg, max_len)
        cache = model.allocate_cache(num_blocks, cfg.scheduler.block_size, self.device)
        heads = load_heads(cfg, args, weights) if cfg.speculative.enabled else None
        bind_features(model, heads)
        k = cfg.speculative.num_draft_tokens if heads else 0
        proposed = cfg.speculative.proposed_tokens if heads else 0
        self.limits = step_limits(cfg, args.vocab_size, args.hidden_size, num_blocks, max_len=max_len, k=proposed)
        local = self.world == 1  # this process holds the whole target: its steps can fold a colocated draft in
        if self.rank == 0 and heads:
            if draft is not None:
                address, name, node = draft
                if node == node_ip() and cfg.parallel.step_transport == "auto":
                    self.draft_link = draft_link(name)
                else:
                    self.draft_stub = wpb_grpc.DraftWorkerStub(grpc.insecure_channel(address, channel_options()))
                local = False
            elif self.world == 1:  # the draft shares this process's model: the same captured steps as in process
                self.draft = build_draft(cfg, heads, model, num_blocks, device=self.device, dtype=dtype)
            else:
                shared = build_shared(cfg, args, weights, dtype, device=self.device)
                self.draft = build_draft(cfg, heads, shared, num_blocks, device=self.device, dtype=dtype)
                build_chain_graphs(cfg, self.draft, max_len)
        parts = TargetParts(model, cache, torch.device(self.device))
        drafting = self.rank == 0 and bool(heads)
        self.runner = build_runner(
            cfg, parts, self.draft if local else None, k, max_len=max_len, local=local, drafting=drafting
        )
        freeze_startup_heap(f"target rank {self.rank}")
        return num_blocks

    def ready(self) -> int:
        """Liveness probe for Ray: returns the process id."""
        return os.getpid()

    def Ping(self, request: wpb.PingRequest, context: grpc.ServicerContext) -> wpb.PingResponse:
        """gRPC liveness probe."""
        return wpb.PingResponse(rank=self.rank, pid=os.getpid())

    def _session(self) -> StepSession:
        if self.runner is None or self.limits is None:
            raise StepFailure("FAILED_PRECONDITION", f"rank {self.rank} is not set up")
        return StepSession(self.runner, self.limits, self.rank, self._run_draft)

    def Execute(self, request: wpb.StepPlan, context: grpc.ServicerContext) -> wpb.TargetOutput:
        """Run one step; rank 0 returns tokens and draft proposals, other ranks an empty result."""
        try:
            session = self._session()
            plan = decode_plan(request, session.limits)
            with self._lock:
                out = session.execute(plan)
        except StepFailure as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
        return target_output_to_proto(out) if self.rank == 0 else wpb.TargetOutput(step_id=out.step_id)

    def Steps(
        self, request_iterator: Iterator[wpb.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[wpb.TargetOutput]:
        """The long-lived step stream (see `workers/step_session.py`)."""
        return self._serve_steps(request_iterator)

    def _serve_steps(self, requests: Iterator[wpb.StepRequest]) -> Iterator[wpb.TargetOutput]:
        try:
            session = self._session()
        except StepFailure as exc:
            yield wpb.TargetOutput(error=wpb.StepError(code=exc.code, message=str(exc)))
            return
        for req in requests:
            with self._lock:  # held across the sends: the launch after an early reply belongs to this request
                yield from session.handle(req)
            if session.failed:
                return

    def _run_draft(self, out: TargetOutput) -> None:
        inputs, out.draft_inputs = out.draft_inputs, None
        if inputs is None:
            return
        if self.draft is not None:
            out.draft_outputs = self.draft.propose(inputs)
        else:
            msg = draft_inputs_to_proto(inputs)
            reply = self._propose(msg)
            out.draft_outputs = draft_outputs_from_proto(reply)
            out.timing["draft_inputs_bytes"] = msg.ByteSize()
            out.timing["draft_outputs_bytes"] = reply.ByteSize()

    def _propose(self, msg: wpb.DraftInputs) -> wpb.DraftOutputs:
        """The separate draft worker's answer, over the draft link on this node or gRPC from another."""
        timeout = self.cfg.parallel.step_timeout_s
        if self.draft_link is not None:
            try:
                self.draft_link.send(msg, timeout)
                reply, _ = self.draft_link.recv(timeout)
            except (TimeoutError, LinkClosed) as exc:
                raise StepFailure("UNAVAILABLE", f"draft worker failed: {type(exc).__name__}: {exc}") from None
            if reply.HasField("error"):
                raise StepFailure("UNAVAILABLE", f"draft worker failed: {reply.error.code}: {reply.error.message}")
            return reply
        assert self.draft_stub is not None
        try:
            return self.draft_stub.Propose(msg, timeout=timeout)
        except grpc.RpcError as exc:
            raise StepFailure("UNAVAILABLE", f"draft worker failed: {exc.code().name}: {exc.details()}") from None

    def stop(self) -> None:
        """Stop serving."""
        if self.draft_link is not None:
            self.draft_link.close()
        self._listener.close()
        self._server.stop(0)
