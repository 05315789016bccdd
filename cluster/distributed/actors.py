"""Ray actors for the distributed engine: TP target workers in one placement group, an optional draft
worker, the step links to the ranks, and restart-on-failure."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from mtpserve.cluster.engine.errors import PlacementError, WorkerUnavailableError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.engine.scheduler import Scheduler
from mtpserve.modeling.loader import resolve_model
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from mtpserve.speculative.messages import StepPlan, TargetOutput
from mtpserve.workers.builders import config_tree_kind, depth_policy, draft_source, max_model_len, num_blocks_for
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.convert import TIMELINE, plan_to_proto, target_output_from_proto
from mtpserve.workers.grpc_util import channel_options, node_ip
from mtpserve.workers.launch_spec import LaunchSpec
from mtpserve.workers.step_link import LinkClosed, StepLink, connect

Kind = wpb.StepRequest.Kind

log = logging.getLogger(__name__)


def connect_ray(address: str | None) -> None:
    """Join `address` (or the job's cluster), or start a local Ray cluster; no-op if already connected."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)


def node_gpus(nodes: list[dict[str, Any]]) -> list[int]:
    """GPUs of each alive node, from `ray.nodes()`."""
    return [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)]


def check_gpus(needed: int, per_node: list[int], tp: int, separate: bool) -> None:
    """Raise PlacementError unless one node has `needed` GPUs (the workers are packed on one node)."""
    most = max(per_node, default=0)
    if most >= needed:
        return
    parts = f"parallel.tp_size={tp} target ranks" + (" + 1 separate draft worker" if separate else "")
    hint = " or parallel.draft_placement=colocated (the draft runs on rank 0's GPU)" if separate else ""
    raise PlacementError(
        f"{parts} need {needed} GPUs on one node, but the largest node has {most}; lower parallel.tp_size{hint}"
    )


class WorkerGroup:
    """The target ranks (and a separate draft worker) as Ray actors, with their gRPC addresses."""

    def __init__(self, cfg: MTPServeConfig, pg_name: str = "") -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mtpserve.workers.draft_worker import DraftWorker
        from mtpserve.workers.target_worker import TargetWorker

        self.cfg = cfg
        tp = cfg.parallel.tp_size
        gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpu = cfg.model.device == "cuda" or (cfg.model.device == "auto" and gpus > 0)
        separate = cfg.speculative.enabled and cfg.parallel.draft_placement == "separate"
        unit = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 0.5}
        bundles = [dict(unit) for _ in range(tp + (1 if separate else 0))]
        if use_gpu:
            check_gpus(len(bundles), node_gpus(ray.nodes()), tp, separate)
        if pg_name:
            remove_stale_group(pg_name)
        self.pg = placement_group(bundles, strategy="STRICT_PACK" if use_gpu else "PACK", name=pg_name)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise PlacementError(
                f"Ray could not place {len(bundles)} worker bundles of {unit} on one node within 120 s "
                f"(cluster: {ray.cluster_resources()}); lower parallel.tp_size or use "
                "parallel.draft_placement=colocated"
            ) from None
        opts: dict[str, Any] = {"num_cpus": unit["CPU"], "num_gpus": unit.get("GPU", 0), "max_restarts": -1}
        cfg_json = cfg.model_dump_json()

        def where(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

        target_cls = ray.remote(TargetWorker)
        self.targets: list[Any] = [
            target_cls.options(**opts, scheduling_strategy=where(r)).remote(cfg_json, r, tp)  # type: ignore[attr-defined]
            for r in range(tp)
        ]
        self.draft: Any = None
        if separate:
            draft_cls = ray.remote(DraftWorker)
            self.draft = draft_cls.options(**opts, scheduling_strategy=where(tp)).remote(cfg_json)  # type: ignore[attr-defined]
        self.stubs: list[wpb_grpc.TargetWorkerStub] = []
        self.links: list[StepLink] = []
        self._channels: list[grpc.Channel] = []
        self.spec: LaunchSpec | None = None  # which steps rank 0 queues ahead
        self.step_costs: dict[tuple[int, int], float] | None = None  # timed fused depth steps (adaptive)

    @property
    def actors(self) -> list[Any]:
        """Every actor handle."""
        return self.targets + ([self.draft] if self.draft is not None else [])

    def setup(self, timeout: float = 600.0) -> None:
        """(Re)load every worker, form the TP group and connect the gRPC stubs."""
        import ray

        ray.get([a.ready.remote() for a in self.actors], timeout=timeout)
        draft_endpoint = None
        if self.draft is not None:
            ray.get(self.draft.setup.remote(), timeout=timeout)
            draft_endpoint = ray.get(self.draft.endpoint.remote())
        master = ray.get(self.targets[0].master_address.remote())
        ray.get([t.setup.remote(master, draft_endpoint) for t in self.targets], timeout=timeout)
        endpoints = ray.get([t.endpoint.remote() for t in self.targets])
        self.close_links()
        self._channels = [grpc.insecure_channel(e[0], channel_options()) for e in endpoints]
        self.stubs = [wpb_grpc.TargetWorkerStub(ch) for ch in self._channels]
        here, transport = node_ip(), self.cfg.parallel.step_transport
        self.links = [connect(addr, name, node == here and transport == "auto") for addr, name, node in endpoints]
        self.spec = ray.get(self.targets[0].launch_spec.remote())
        self.step_costs = ray.get(self.targets[0].step_costs.remote())

    def close_links(self) -> None:
        """Close the step links and the ranks' gRPC channels (a rank drops the step it launched for a
        closed link)."""
        for link in self.links:
            try:
                link.close()
            except OSError as exc:
                log.debug("closing a step link: %s", exc)
        for channel in self._channels:
            channel.close()
        self.links, self._channels = [], []

    def restart(self) -> None:
        """Kill every actor so Ray restarts them all fresh (a surviving rank may be stuck in a collective)."""
        import ray

        self.close_links()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=False)
            except Exception as exc:  # already dead
                log.debug("kill: %s", exc)

    def shutdown(self) -> None:
        """Kill the actors for good and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.close_links()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as exc:
                log.debug("kill: %s", exc)
        remove_placement_group(self.pg)


@dataclass(eq=False)
class RemoteStep:
    """A step sent to the ranks whose reply is not read yet (compared by identity: `collect` looks it up among
    the unanswered ones)."""

    plan: StepPlan
    sent: float  # perf_counter() when it was sent


class RemoteTarget:
    """The target ranks as one executor over their step links: every rank gets every step; rank 0 answers.

    `execute` runs a step and waits for it. `launch` / `collect` queue a captured generation step on the
    ranks and read it later, as `TargetRunner` does in process, so the engine plans steps n+1 .. n+d while
    the ranks run step n (d = `steps_ahead`; only plans the ranks' `LaunchSpec` takes). When a worker fails,
    or a step outlasts `parallel.step_timeout_s` (a stalled worker), the step raises WorkerUnavailableError,
    health turns NOT_SERVING, and a background thread restarts all workers through Ray; health turns SERVING when
    they are back.
    """

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.healthy = True
        self.drafting = False  # whether the ranks run a draft (the engine overlaps such steps only if asked)
        self.joins = False  # the ranks launch generation steps only: arrivals join in steps run in turn
        self.listeners: list[Callable[[bool], None]] = []
        self.hops: dict[str, float] = {"steps": 0.0}
        self.steps_ahead = group.cfg.model.launched_ahead(remote=True)
        self._unanswered: deque[RemoteStep] = deque()  # launched, and not yet released for an answer, oldest first
        self._owed = 0  # replies every rank still sends for the steps sent so far
        self.timeline: deque[dict[str, float]] = deque(maxlen=4096)  # per answered step, both hosts' stamps
        self._turn: list[dict[str, float]] = []  # answered steps waiting for the scheduler's next send
        self._recovering = threading.Lock()
        self._stopped = False

    def execute(self, plan: StepPlan) -> TargetOutput:
        """Run a step on every rank and return rank 0's answer; raises WorkerUnavailableError if any
        worker is down."""
        return self.collect(self._send(Kind.EXECUTE, plan))

    def launch(self, plan: StepPlan, after: RemoteStep | None = None) -> RemoteStep | None:
        """Queue a captured generation step on the ranks (inputs from `after`'s results when given; see
        `TargetRunner.launch`); None when the ranks would not queue it (run it with `execute`)."""
        spec = self.group.spec
        if spec is None or spec.bucket_for(plan) is None:
            return None
        step = self._send(Kind.LAUNCH_AFTER if after is not None else Kind.LAUNCH, plan)
        self._unanswered.append(step)
        while len(self._unanswered) > self.steps_ahead:  # the ranks answer these after queueing this one
            self._unanswered.popleft()
        return step

    def collect(self, step: RemoteStep) -> TargetOutput:
        """Read a sent step's answer (releasing it first when the ranks keep it unanswered)."""
        while step in self._unanswered:
            self._send(Kind.COLLECT, None)
            self._unanswered.popleft()
        t0 = time.perf_counter()
        replies = self._receive(step.plan.step_id)
        t1 = time.perf_counter()
        reply, size = replies[0]
        out = target_output_from_proto(reply)
        self._count(step, out, size, wait=t1 - t0, decode=time.perf_counter() - t1)
        return out

    def discard(self) -> None:
        """Read and drop the replies still owed for steps the engine gave up on (a step that raised), so
        that the next step's reply is its own."""
        if not self.healthy:
            return
        while self._unanswered:
            self._send(Kind.COLLECT, None)
            self._unanswered.popleft()
        while self._owed:
            self._receive(None)

    def _receive(self, step_id: int | None) -> list[tuple[wpb.TargetOutput, int]]:
        """One reply from every rank, all within one step timeout; any failure, or a reply to another step
        than `step_id` (None: any), marks the workers failed."""
        timeout = self.group.cfg.parallel.step_timeout_s
        deadline = time.monotonic() + timeout
        what = f"step {step_id}" if step_id is not None else "a dropped step"
        try:
            replies = [link.recv(max(deadline - time.monotonic(), 1e-3)) for link in self.group.links]
        except TimeoutError:
            raise self._fail(f"a worker stalled: {what} took over parallel.step_timeout_s = {timeout:g} s") from None
        except LinkClosed as exc:
            raise self._fail(f"a worker failed during {what}: {exc}") from None
        self._owed -= 1
        failed = [r.error for r, _ in replies if r.HasField("error")]
        if failed:
            raise self._fail(f"a worker failed {what}: {failed[0].code}: {failed[0].message}")
        ids = {r.step_id for r, _ in replies}
        if step_id is not None and ids != {step_id}:
            raise self._fail(f"the ranks answered step(s) {sorted(ids)} where step {step_id} was due")
        return replies

    def _send(self, kind: int, plan: StepPlan | None) -> RemoteStep:
        if not self.healthy:
            raise WorkerUnavailableError("workers are restarting; retry shortly")
        t0 = time.perf_counter()
        req = wpb.StepRequest(kind=kind, unanswered=self.steps_ahead)  # type: ignore[arg-type]
        if plan is not None:
            req.plan.CopyFrom(plan_to_proto(plan))
        if kind == Kind.EXECUTE:
            self._unanswered.clear()  # the ranks answer every launched step first
        for record in self._turn:
            record["next_send"] = t0
        self._turn = []
        size = 0
        timeout = self.group.cfg.parallel.step_timeout_s
        try:
            for link in self.group.links:
                size = link.send(req, timeout)
        except (LinkClosed, TimeoutError) as exc:
            raise self._fail(f"a worker's step link broke or stalled: {exc}") from None
        if kind in (Kind.EXECUTE, Kind.LAUNCH, Kind.LAUNCH_AFTER):
            self._owed += 1
        h = self.hops
        h["plan_bytes"] = h.get("plan_bytes", 0.0) + size
        h["encode_s"] = h.get("encode_s", 0.0) + time.perf_counter() - t0
        return RemoteStep(plan if plan is not None else StepPlan(-1, [], 0), t0)

    def _count(self, step: RemoteStep, out: TargetOutput, size: int, wait: float, decode: float) -> None:
        h, t = self.hops, out.timing
        now = time.perf_counter()
        round_trip = now - step.sent
        record = {"sent": step.sent, "got": now - decode, **{k: t[k] for k in TIMELINE if k.startswith("t_")}}
        self.timeline.append(record)
        self._turn.append(record)
        adds = {
            "steps": 1.0,
            "output_bytes": float(size),
            "wait_s": wait,
            "decode_s": decode,
            "rpc_s": round_trip,
            "worker_s": t.get("worker_s", 0.0),
            "transit_s": max(0.0, round_trip - t.get("worker_s", 0.0)),
        }
        for key in ("target_s", "draft_hop_s", "draft_inputs_bytes", "draft_outputs_bytes"):
            adds[key] = t.get(key, 0.0)
        for key, v in adds.items():
            h[key] = h.get(key, 0.0) + v

    def _fail(self, reason: str) -> WorkerUnavailableError:
        """Start restarting the workers (once); returns the error for the step that saw the failure."""
        self._unanswered.clear()
        self._owed = 0
        if self.healthy:
            log.error("worker failure: %s; restarting workers", reason)
            self.healthy = False
            self._notify(False)
            threading.Thread(target=self._recover, name="mtpserve-recover", daemon=True).start()
        return WorkerUnavailableError(reason)

    def _recover(self) -> None:
        with self._recovering:
            self.group.restart()
            while not self._stopped:
                try:
                    self.group.setup(timeout=300)
                    self.healthy = True
                    log.info("workers restored")
                    self._notify(True)
                    return
                except Exception as exc:
                    log.warning("waiting for workers to restart: %s", exc)
                    time.sleep(1.0)

    def _notify(self, ok: bool) -> None:
        for fn in self.listeners:
            try:
                fn(ok)
            except Exception:
                log.exception("health listener failed")

    def ping(self, timeout: float = 5.0) -> bool:
        """True if every rank answers."""
        try:
            for stub in self.group.stubs:
                stub.Ping(wpb.PingRequest(), timeout=timeout)
            return True
        except grpc.RpcError:
            return False

    def shutdown(self) -> None:
        """Stop recovery and release the actors."""
        self._stopped = True
        self.group.shutdown()


def remove_stale_group(name: str) -> None:
    """Remove the placement group called `name` if one is left: a placement group outlives the actor that
    made it, so a restarted scheduler actor would otherwise hold its crashed incarnation's bundles too."""
    import ray.util

    try:
        stale = ray.util.get_placement_group(name)
    except ValueError:
        return
    log.warning("removing placement group %s left by a previous scheduler", name)
    ray.util.remove_placement_group(stale)


def build_distributed_engine(cfg: MTPServeConfig, pg_name: str = "") -> LLMEngine:
    """An LLMEngine whose target (and draft) run in Ray actors; `pg_name` names their placement group (a
    scheduler actor passes one that survives its restarts)."""
    connect_ray(cfg.parallel.ray_address)
    group = WorkerGroup(cfg, pg_name)
    try:
        group.setup()
    except Exception:
        group.shutdown()
        raise
    return engine_over(cfg, group)


def engine_over(cfg: MTPServeConfig, group: Any) -> LLMEngine:
    """The scheduler side of a distributed engine over a set-up worker group (`WorkerGroup`: its config,
    step links, launch spec and timed step costs)."""
    source = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir)
    args = source.args()
    target = RemoteTarget(group)
    max_len = max_model_len(cfg, args)
    spec = cfg.speculative
    drafting = draft_source(cfg, args) is not None
    target.drafting = drafting
    k, scratch = (spec.proposed_tokens, spec.scratch_slots) if drafting else (0, 0)
    blocks = num_blocks_for(cfg, max_len)
    depth = None
    tree = config_tree_kind(cfg) if drafting else None
    if drafting and spec.adaptive:
        depth = depth_policy(cfg, spec.num_draft_tokens, timed=group.step_costs, tree=tree)
    sched = Scheduler(
        cfg.scheduler,
        blocks,
        k,
        eos_token_ids=args.eos_ids(),
        max_model_len=max_len,
        prefix_caching=cfg.prefix_caching,
        scratch_slots=scratch,
        depth=depth,
        tree=tree,
    )
    tok = source.tokenizer() if not source.dummy else None
    engine = LLMEngine(cfg, args, sched, target, draft=None, tokenizer=tok)
    engine.health_listeners = target.listeners
    return engine
