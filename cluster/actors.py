"""Ray actors for the distributed engine: TP target workers in one placement group, an optional draft
worker, gRPC stubs between them, and restart-on-failure."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from cluster.engine import LLMEngine
from cluster.errors import PlacementError, WorkerUnavailableError
from cluster.scheduler import Scheduler
from modeling.loader import resolve_model
from proto.mtpserve.v1 import worker_pb2 as wpb
from proto.mtpserve.v1 import worker_pb2_grpc as wpb_grpc
from speculative.messages import StepPlan, TargetOutput
from workers.builders import depth_policy, draft_source, max_model_len, num_blocks_for
from workers.config import MTPServeConfig
from workers.convert import plan_to_proto, target_output_from_proto
from workers.grpc_util import channel_options

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

        from workers.draft_worker import DraftWorker
        from workers.target_worker import TargetWorker

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

    @property
    def actors(self) -> list[Any]:
        """Every actor handle."""
        return self.targets + ([self.draft] if self.draft is not None else [])

    def setup(self, timeout: float = 600.0) -> None:
        """(Re)load every worker, form the TP group and connect the gRPC stubs."""
        import ray

        ray.get([a.ready.remote() for a in self.actors], timeout=timeout)
        draft_addr = None
        if self.draft is not None:
            ray.get(self.draft.setup.remote(), timeout=timeout)
            draft_addr = ray.get(self.draft.address.remote())
        master = ray.get(self.targets[0].master_address.remote())
        ray.get([t.setup.remote(master, draft_addr) for t in self.targets], timeout=timeout)
        addrs = ray.get([t.address.remote() for t in self.targets])
        self.stubs = [wpb_grpc.TargetWorkerStub(grpc.insecure_channel(a, channel_options())) for a in addrs]

    def restart(self) -> None:
        """Kill every actor so Ray restarts them all fresh (a surviving rank may be stuck in a collective)."""
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=False)
            except Exception as exc:  # already dead
                log.debug("kill: %s", exc)

    def shutdown(self) -> None:
        """Kill the actors for good and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as exc:
                log.debug("kill: %s", exc)
        remove_placement_group(self.pg)


class RemoteTarget:
    """TargetExecutor over gRPC: sends every rank the same StepPlan, returns rank 0's answer.

    When a worker fails, or a step outlasts `parallel.step_timeout_s` (a stalled worker), the step raises
    WorkerUnavailableError, health turns NOT_SERVING, and a background thread restarts all workers
    through Ray; health turns SERVING when they are back.
    """

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.healthy = True
        self.listeners: list[Callable[[bool], None]] = []
        self.hops: dict[str, float] = {"steps": 0, "plan_bytes": 0, "output_bytes": 0, "rpc_s": 0.0, "target_s": 0.0}
        self._recovering = threading.Lock()
        self._stopped = False

    def execute(self, plan: StepPlan) -> TargetOutput:
        """Run a step on every rank; raises WorkerUnavailableError if any worker is down."""
        if not self.healthy:
            raise WorkerUnavailableError("workers are restarting; retry shortly")
        msg = plan_to_proto(plan)
        t0 = time.perf_counter()
        timeout = self.group.cfg.parallel.step_timeout_s
        calls = [stub.Execute.future(msg, timeout=timeout) for stub in self.group.stubs]
        try:
            replies = [c.result() for c in calls]
        except grpc.RpcError as exc:
            for c in calls:
                c.cancel()
            self._fail(f"{exc.code().name}: {exc.details()}")
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"a worker stalled: step {plan.step_id} took over parallel.step_timeout_s = {timeout:g} s"
                raise WorkerUnavailableError(why) from None
            raise WorkerUnavailableError(f"a worker failed during step {plan.step_id}: {exc.details()}") from None
        out = target_output_from_proto(replies[0])
        h = self.hops
        h["steps"] += 1
        h["plan_bytes"] += msg.ByteSize()
        h["output_bytes"] += replies[0].ByteSize()
        h["rpc_s"] += time.perf_counter() - t0
        h["target_s"] += out.timing.get("target_s", 0.0)
        for key in ("draft_hop_s", "draft_inputs_bytes", "draft_outputs_bytes"):
            h[key] = h.get(key, 0.0) + out.timing.get(key, 0.0)
        return out

    def _fail(self, reason: str) -> None:
        if not self.healthy:
            return
        log.error("worker failure: %s; restarting workers", reason)
        self.healthy = False
        self._notify(False)
        threading.Thread(target=self._recover, name="mtpserve-recover", daemon=True).start()

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
    """An LLMEngine whose target (and draft) run in Ray actors connected by gRPC; `pg_name` names their
    placement group (a scheduler actor passes one that survives its restarts)."""
    connect_ray(cfg.parallel.ray_address)
    source = resolve_model(cfg.model.path, cfg.model.load_format, cfg.model.cache_dir)
    args = source.args()
    group = WorkerGroup(cfg, pg_name)
    try:
        group.setup()
    except Exception:
        group.shutdown()
        raise
    target = RemoteTarget(group)
    max_len = max_model_len(cfg, args)
    spec = cfg.speculative
    drafting = draft_source(cfg, args) is not None
    k, scratch = (spec.proposed_tokens, spec.scratch_slots) if drafting else (0, 0)
    blocks = num_blocks_for(cfg, max_len)
    depth = depth_policy(cfg, k) if drafting and spec.adaptive else None
    sched = Scheduler(cfg.scheduler, blocks, k, args.eos_ids(), max_len, cfg.prefix_caching, scratch, depth)
    tok = source.tokenizer() if not source.dummy else None
    engine = LLMEngine(cfg, args, sched, target, None, tok)
    engine.health_listeners = target.listeners
    return engine
