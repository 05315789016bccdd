"""TargetWorker: one tensor-parallel rank (model shard, KV cache) serving StepPlans over gRPC.

Run as a Ray actor (`cluster/actors.py`); rank 0 also forwards DraftInputs to the draft, either in its
own process (colocated) or to the DraftWorker over gRPC (separate), and returns both results.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import torch

from modeling.loader import resolve_device, to_dtype
from proto.mtpserve.v1 import worker_pb2 as wpb
from proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from speculative.messages import TargetOutput
from speculative.methods import DraftMethod
from workers.builders import (
    bind_features,
    build_chain_graphs,
    build_draft,
    build_runner,
    build_shared,
    build_target,
    load_heads,
    load_target,
    max_model_len,
    num_blocks_for,
)
from workers.config import MTPServeConfig
from workers.convert import (
    draft_inputs_to_proto,
    draft_outputs_from_proto,
    plan_from_proto,
    target_output_to_proto,
)
from workers.distributed import free_port, init_tp_group
from workers.grpc_util import channel_options, node_ip, start_server
from workers.message_checks import StepLimits, check_plan
from workers.runner import TargetRunner


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
        self.draft_stub: wpb_grpc.DraftWorkerStub | None = None
        self.limits: StepLimits | None = None
        self._lock = threading.Lock()
        self._server, self.port = start_server(lambda s: wpb_grpc.add_TargetWorkerServicer_to_server(self, s))

    def address(self) -> str:
        """host:port of this rank's gRPC server."""
        return f"{node_ip()}:{self.port}"

    def master_address(self) -> str:
        """A fresh host:port for the process group's rendezvous (asked of rank 0)."""
        return f"{node_ip()}:{free_port()}"

    def setup(self, master: str, draft_address: str | None) -> int:
        """Join the TP group, load this rank's shard and (rank 0) the draft; returns the KV block count."""
        cfg = self.cfg
        tp = init_tp_group(self.rank, self.world, master, self.device)
        _, args, weights = load_target(cfg)
        dtype = to_dtype(cfg.model.dtype, self.device)
        model = build_target(args, weights, dtype, self.device, tp, cfg.model.fused_kernels, cfg.model.pdl)
        max_len = max_model_len(cfg, args)
        num_blocks = num_blocks_for(cfg, max_len)
        cache = model.allocate_cache(num_blocks, cfg.scheduler.block_size, self.device)
        heads = load_heads(cfg, args, weights) if cfg.speculative.enabled else None
        bind_features(model, heads)
        k = cfg.speculative.num_draft_tokens if heads else 0
        self.runner = build_runner(cfg, model, cache, self.device, k, max_len)
        self.runner.drafting = self.rank == 0 and bool(heads)
        proposed = cfg.speculative.proposed_tokens if heads else 0
        self.limits = step_limits(cfg, args.vocab_size, args.hidden_size, num_blocks, max_len, proposed)
        if self.rank == 0 and heads:
            if draft_address:
                self.draft_stub = wpb_grpc.DraftWorkerStub(grpc.insecure_channel(draft_address, channel_options()))
            else:
                shared = model if self.world == 1 else build_shared(cfg, args, weights, dtype, self.device)
                self.draft = build_draft(cfg, heads, shared, num_blocks, self.device, dtype)
                build_chain_graphs(cfg, self.draft, max_len)
        return num_blocks

    def ready(self) -> int:
        """Liveness probe for Ray: returns the process id."""
        return os.getpid()

    def Ping(self, request: wpb.PingRequest, context: grpc.ServicerContext) -> wpb.PingResponse:
        """gRPC liveness probe."""
        return wpb.PingResponse(rank=self.rank, pid=os.getpid())

    def Execute(self, request: wpb.StepPlan, context: grpc.ServicerContext) -> wpb.TargetOutput:
        """Run one step; rank 0 returns tokens and draft proposals, other ranks an empty result."""
        if self.runner is None or self.limits is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rank {self.rank} is not set up")
        try:
            plan = plan_from_proto(request)
            check_plan(plan, self.limits)  # type: ignore[arg-type]
        except ValueError as exc:  # InvalidStepMessage, or a tensor the codec refuses
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"StepPlan.{exc}")
        with self._lock:
            t0 = time.perf_counter()
            out = self.runner.execute(plan)  # type: ignore[union-attr]
            if self.rank != 0:
                return wpb.TargetOutput(step_id=out.step_id)
            t1 = time.perf_counter()
            self._run_draft(out, context)
            out.timing["target_s"] = t1 - t0
            out.timing["draft_hop_s"] = time.perf_counter() - t1
            return target_output_to_proto(out)

    def _run_draft(self, out: TargetOutput, context: grpc.ServicerContext) -> None:
        inputs, out.draft_inputs = out.draft_inputs, None
        if inputs is None:
            return
        if self.draft is not None:
            out.draft_outputs = self.draft.propose(inputs)
        elif self.draft_stub is not None:
            msg = draft_inputs_to_proto(inputs)
            try:
                reply = self.draft_stub.Propose(msg, timeout=self.cfg.parallel.step_timeout_s)
            except grpc.RpcError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"draft worker failed: {exc.code().name}: {exc.details()}")
            out.draft_outputs = draft_outputs_from_proto(reply)
            out.timing["draft_inputs_bytes"] = msg.ByteSize()
            out.timing["draft_outputs_bytes"] = reply.ByteSize()

    def stop(self) -> None:
        """Stop serving."""
        self._server.stop(0)
