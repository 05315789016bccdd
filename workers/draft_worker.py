"""DraftWorker: the MTP Eagle chain on its own device, serving DraftInputs over its draft link (rank 0 on
the same node) or gRPC (`Propose`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import torch

from mtpserve.modeling.loader import to_dtype
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from mtpserve.speculative.methods import DraftMethod
from mtpserve.workers.builders import (
    build_draft,
    build_shared,
    load_heads,
    load_target,
    max_model_len,
    num_blocks_for,
)
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.convert import draft_inputs_from_proto, draft_outputs_to_proto
from mtpserve.workers.grpc_util import node_ip, start_server
from mtpserve.workers.heap import freeze_startup_heap
from mtpserve.workers.message_checks import StepLimits, check_draft_inputs
from mtpserve.workers.step_builders import build_chain_graphs
from mtpserve.workers.step_link import draft_listener
from mtpserve.workers.step_session import StepFailure
from mtpserve.workers.target_worker import step_limits, worker_device


class DraftWorker(wpb_grpc.DraftWorkerServicer):
    """Holds the draft head, its KV cache and lookahead tensor, plus the target's embedding and head."""

    def __init__(self, cfg_json: str) -> None:
        self.cfg = MTPServeConfig.model_validate_json(cfg_json)
        self.device = worker_device(self.cfg)
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.method: DraftMethod | None = None
        self.limits: StepLimits | None = None
        self._lock = threading.Lock()
        self._server, self.port = start_server(lambda s: wpb_grpc.add_DraftWorkerServicer_to_server(self, s))
        self._listener = draft_listener(self._serve_link)

    def address(self) -> str:
        """host:port of the gRPC server."""
        return f"{node_ip()}:{self.port}"

    def endpoint(self) -> tuple[str, str, str]:
        """(gRPC host:port, Unix socket name, node address) for rank 0's draft link."""
        return self.address(), self._listener.name, node_ip()

    def setup(self) -> int:
        """Load the draft head and the target's shared embedding / final norm / lm_head."""
        cfg = self.cfg
        _, args, weights = load_target(cfg)
        dtype = to_dtype(cfg.model.dtype, self.device)
        shared = build_shared(cfg, args, weights, dtype, device=self.device)
        max_len = max_model_len(cfg, args)
        num_blocks = num_blocks_for(cfg, max_len)
        self.method = build_draft(
            cfg, load_heads(cfg, args, weights), shared, num_blocks, device=self.device, dtype=dtype
        )
        if self.method is None:
            raise ValueError("speculative.draft resolves to no head; the draft worker has nothing to run")
        build_chain_graphs(cfg, self.method, max_len)
        k = cfg.speculative.proposed_tokens
        self.limits = step_limits(cfg, args.vocab_size, args.hidden_size, num_blocks, max_len=max_len, k=k)
        freeze_startup_heap("draft worker")
        return num_blocks

    def ready(self) -> int:
        """Liveness probe for Ray."""
        return os.getpid()

    def Ping(self, request: wpb.PingRequest, context: grpc.ServicerContext) -> wpb.PingResponse:
        """gRPC liveness probe."""
        return wpb.PingResponse(rank=-1, pid=os.getpid())

    def Propose(self, request: wpb.DraftInputs, context: grpc.ServicerContext) -> wpb.DraftOutputs:
        """Copy the step's rows into the draft's buffers, update draft KV, return K proposals per request."""
        try:
            return self._propose(request)
        except StepFailure as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
            raise  # abort raises; this line is never reached

    def _propose(self, request: wpb.DraftInputs) -> wpb.DraftOutputs:
        if self.method is None or self.limits is None:
            raise StepFailure("FAILED_PRECONDITION", "draft worker is not set up")
        try:
            inputs = draft_inputs_from_proto(request, self.device)
            check_draft_inputs(inputs, self.limits)
        except ValueError as exc:  # InvalidStepMessage, or a tensor the codec refuses
            raise StepFailure("INVALID_ARGUMENT", f"DraftInputs.{exc}") from None
        with self._lock:
            out = self.method.propose(inputs)
        return draft_outputs_to_proto(out)

    def _serve_link(self, requests: Iterator[wpb.DraftInputs]) -> Iterator[wpb.DraftOutputs]:
        """Answer rank 0's draft steps in order; a failure is answered, then ends the link."""
        for request in requests:
            try:
                yield self._propose(request)
            except StepFailure as exc:
                yield wpb.DraftOutputs(step_id=request.step_id, error=wpb.StepError(code=exc.code, message=str(exc)))
                return

    def draft_kv(self, block_ids: list[int], n: int) -> torch.Tensor:
        """Draft K and V [2, n, H, D] of positions [0, n) under a block table (for invariance checks)."""
        cache = self.method.cache  # type: ignore[union-attr]
        pos = torch.arange(n)
        slots = torch.tensor(block_ids)[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        k, v = cache.gather(0, slots.to(cache.keys[0].device))
        return torch.stack([k, v]).float().cpu()

    def stop(self) -> None:
        """Stop serving."""
        self._listener.close()
        self._server.stop(0)
