"""A target rank's side of the step stream: runs, launches and collects steps in the scheduler's order.

The scheduler sends EXECUTE for a step it needs answered at once, LAUNCH / LAUNCH_AFTER for a captured
generation step it wants launched on the device while it plans the next ones, and COLLECT to have the oldest
launched step answered when nothing more follows. A LAUNCH message says how many launched steps, its own
included, stay unanswered after it (the scheduler's steps ahead); the older ones are answered. If the device
is still running such a step, the new step is launched first, so the device is never idle for the hop. If it
has finished, its reply goes out before the new step is launched, so the scheduler plans while this rank
queues, instead of waiting for it. Before an EXECUTE every launched step is answered. Messages that do not
fit this order are refused.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.speculative.messages import StepPlan, TargetOutput
from mtpserve.workers.config import MAX_STEPS_AHEAD
from mtpserve.workers.convert import plan_from_proto, target_output_to_proto
from mtpserve.workers.launch_spec import LaunchedStep
from mtpserve.workers.message_checks import StepLimits, check_plan
from mtpserve.workers.runner import TargetRunner

Kind = wpb.StepRequest.Kind


class StepFailure(Exception):
    """A step that failed on the worker, with the gRPC status name it is reported under."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_reply(step_id: int, failure: StepFailure) -> wpb.TargetOutput:
    """A streamed step's failure."""
    return wpb.TargetOutput(step_id=step_id, error=wpb.StepError(code=failure.code, message=str(failure)))


def decode_plan(msg: wpb.StepPlan, limits: StepLimits) -> StepPlan:
    """A received plan, checked against what this rank can run (StepFailure INVALID_ARGUMENT otherwise)."""
    try:
        plan = plan_from_proto(msg)
        check_plan(plan, limits)
    except ValueError as exc:  # InvalidStepMessage, or a tensor the codec refuses
        raise StepFailure("INVALID_ARGUMENT", f"StepPlan.{exc}") from None
    return plan


class StepSession:
    """One scheduler connection's state on a rank: the steps launched and not yet answered, oldest first.

    `run_draft(out)` runs the draft of an executed step (rank 0, a draft not fused into the target's
    step) and raises StepFailure when it cannot."""

    def __init__(
        self,
        runner: TargetRunner,
        limits: StepLimits,
        rank: int,
        run_draft: Callable[[TargetOutput], None],
    ) -> None:
        self.runner = runner
        self.limits = limits
        self.rank = rank
        self.run_draft = run_draft
        self.pending: deque[tuple[LaunchedStep, dict[str, float]]] = deque()  # launched, and their timelines
        self.failed = False  # a request failed: the stream ends after its error reply

    def handle(self, req: wpb.StepRequest) -> Iterator[wpb.TargetOutput]:
        """The replies one request releases, each as soon as it is ready: the launched step's, then its own;
        a failure's reply ends them and sets `failed`."""
        try:
            yield from self._handle(req)
        except StepFailure as exc:
            self.pending.clear()
            self.failed = True
            yield error_reply(req.plan.step_id, exc)

    def _handle(self, req: wpb.StepRequest) -> Iterator[wpb.TargetOutput]:
        t0 = time.perf_counter()
        if req.kind == Kind.COLLECT:
            if not self.pending:
                raise StepFailure("FAILED_PRECONDITION", "COLLECT with no launched step to answer")
            yield self._finish()
            return
        plan = decode_plan(req.plan, self.limits)
        decode_s = time.perf_counter() - t0
        if req.kind == Kind.EXECUTE:
            while self.pending:
                yield self._finish()
            yield self._execute(plan, t0, decode_s)
            return
        if req.unanswered > MAX_STEPS_AHEAD:
            why = f"is {req.unanswered}; a rank keeps at most {MAX_STEPS_AHEAD} launched steps unanswered"
            raise StepFailure("INVALID_ARGUMENT", f"StepRequest.unanswered {why}")
        after = None
        if req.kind == Kind.LAUNCH_AFTER:
            after = self._previous(plan)
        owed = len(self.pending) + 1 - max(1, req.unanswered)  # launched steps this message releases
        while owed > 0 and self._finished(self.pending[0][0]):
            owed -= 1
            yield self._finish()  # the scheduler plans the step after while this one is launched
        launched = self.runner.launch(plan, after)
        if launched is None:
            why = f"step {plan.step_id} is not a captured generation step of this rank; it cannot be launched"
            raise StepFailure("FAILED_PRECONDITION", why)
        t1 = time.perf_counter()
        for _ in range(owed):
            yield self._finish()
        self.pending.append((launched, {"t_received": t0, "t_queued": t1, "decode_s": decode_s, "worker_s": t1 - t0}))

    @staticmethod
    def _finished(launched: LaunchedStep) -> bool:
        """Whether the device has finished a launched step (always, off CUDA: those steps run as launched)."""
        return launched.ready is None or bool(launched.ready.query())

    def _previous(self, plan: StepPlan) -> LaunchedStep:
        """The launched step a LAUNCH_AFTER plan reads from, once its row references are checked."""
        if not self.pending:
            raise StepFailure("FAILED_PRECONDITION", f"step {plan.step_id}: LAUNCH_AFTER with no launched step")
        launched = self.pending[-1][0]
        if launched.plan.num_draft_tokens != plan.num_draft_tokens:
            why = f"LAUNCH_AFTER a step of {launched.plan.num_draft_tokens} drafts: its results are laid out for that"
            raise StepFailure("INVALID_ARGUMENT", f"StepPlan.num_draft_tokens is {plan.num_draft_tokens}; {why}")
        rows = len(launched.plan.seqs)
        for i, s in enumerate(plan.seqs):
            if not 0 <= s.token_ids[0] < rows:
                why = f"row {s.token_ids[0]} of the launched step, which has {rows}"
                raise StepFailure("INVALID_ARGUMENT", f"StepPlan.seqs[{i}].token_ids[0]: {why}")
        return launched

    def _execute(self, plan: StepPlan, t0: float, decode_s: float) -> wpb.TargetOutput:
        t1 = time.perf_counter()
        out = self.execute(plan)
        if self.rank != 0:
            return wpb.TargetOutput(step_id=out.step_id)
        out.timing.update(t_received=t0, t_queued=t1, decode_s=decode_s, worker_s=0.0)
        return self._encode(out, t0)

    def execute(self, plan: StepPlan) -> TargetOutput:
        """Run a step now: the target, then (rank 0) its draft, with their wall times in `timing`."""
        t0 = time.perf_counter()
        out = self.runner.execute(plan)
        if self.rank != 0:
            return out
        t1 = time.perf_counter()
        self.run_draft(out)
        out.timing.update(target_s=t1 - t0, draft_hop_s=time.perf_counter() - t1)
        return out

    def _finish(self) -> wpb.TargetOutput:
        launched, timing = self.pending.popleft()
        t0 = time.perf_counter()
        out = self.runner.collect(launched)
        if self.rank != 0:
            return wpb.TargetOutput(step_id=out.step_id)
        out.timing.update(timing)
        return self._encode(out, t0)

    @staticmethod
    def _encode(out: TargetOutput, t0: float) -> wpb.TargetOutput:
        """The reply, with the rank's busy time since t0 added and its timeline stamps."""
        out.timing["t_done"] = time.perf_counter()
        msg = target_output_to_proto(out)
        msg.timing.t_replied = time.perf_counter()
        msg.timing.worker_s += msg.timing.t_replied - t0
        return msg
