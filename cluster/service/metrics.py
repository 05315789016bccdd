"""Prometheus metrics of one server, in a registry of its own, exposed over HTTP at /metrics.

Per-request metrics (requests, tokens, latencies, refused calls) carry a `frontend` label: "grpc" or "http"
(the OpenAI-compatible API). Engine-wide ones (load, KV blocks, prefix cache, speculation) do not.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mtpserve.cluster.service.metrics_http import MetricsEndpoint
from mtpserve.speculative.stats import SpecStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
GRPC = "grpc"
HTTP = "http"


class ServerMetrics:
    """Counters, gauges and histograms of one server; several servers in a process do not collide.

    With `engine_wide` False the server records only its own requests' metrics: a front end among several, whose
    engine-wide figures one place records for all (`EngineMetrics`, front_end_pool.py)."""

    def __init__(self, prefix: str = "mtpserve", engine_wide: bool = True) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._http: MetricsEndpoint | None = None
        self.port: int | None = None
        self.requests = Counter(
            f"{prefix}_requests",
            "Requests finished, by front end and finish reason (stop, length, abort, error)",
            ["frontend", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{prefix}_prompt_tokens", "Prompt tokens of admitted requests", ["frontend"], registry=r
        )
        self.generation_tokens = Counter(f"{prefix}_generation_tokens", "Tokens generated", ["frontend"], registry=r)
        self.ttft = Histogram(
            f"{prefix}_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            ["frontend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{prefix}_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            ["frontend"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{prefix}_inter_token_latency_seconds",
            "Time between a request's consecutive tokens: one sample per output after the first, its gap over the "
            "tokens it brought (a step's accepted drafts share the gap)",
            ["frontend"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{prefix}_e2e_request_latency_seconds",
            "Time from arrival to the end of a request, by front end",
            ["frontend"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.phases = {
            phase: Histogram(
                f"{prefix}_request_{phase}_time_seconds",
                f"Engine time of a finished request {what}",
                ["frontend"],
                buckets=E2E_BUCKETS if phase == "decode" else TTFT_BUCKETS,
                registry=r,
            )
            for phase, what in (
                ("queue", "from arrival to its first step"),
                ("prefill", "from its first step to its first token"),
                ("decode", "from its first token to its end"),
            )
        }
        self.auth_failures = Counter(
            f"{prefix}_auth_failures",
            "Calls refused for a missing or invalid bearer token, by front end and reason",
            ["frontend", "reason"],
            registry=r,
        )
        self.drafted = Counter(f"{prefix}_spec_drafted_tokens", "Draft tokens proposed and verified", registry=r)
        self.accepted = Counter(f"{prefix}_spec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.verify_steps = Counter(f"{prefix}_spec_verify_steps", "Target verify passes", registry=r)
        self.drafted_per_position = Counter(
            f"{prefix}_spec_drafted_per_position",
            "Verify steps that proposed a draft at this position (0-based)",
            ["position"],
            registry=r,
        )
        self.accepted_per_position = Counter(
            f"{prefix}_spec_accepted_per_position",
            "Verify steps that accepted the draft at this position (0-based)",
            ["position"],
            registry=r,
        )
        self.engine = EngineMetrics(r, prefix) if engine_wide else None

    def observe_phases(self, frontend: str, queued: float, prefill: float, decode: float) -> None:
        """Record the engine's queue, prefill and decode time of a finished request."""
        for phase, seconds in (("queue", queued), ("prefill", prefill), ("decode", decode)):
            self.phases[phase].labels(frontend=frontend).observe(seconds)

    def start_http(self, port: int, addr: str = "0.0.0.0", token: bytes | None = None) -> int:
        """Serve /metrics on `port` (0 picks a free one), behind `token` when given; returns the bound port."""
        self._http = MetricsEndpoint(self.registry, port, addr, token)
        self.port = self._http.port
        return self.port

    def stop_http(self) -> None:
        """Stop the HTTP endpoint (no-op if it was never started)."""
        if self._http is not None:
            self._http.stop()
            self._http = None

    def observe_finish(
        self,
        reason: str,
        num_output_tokens: int,
        decode_s: float | None,
        stats: SpecStats | None,
        frontend: str = GRPC,
    ) -> None:
        """Record a request that ended: its reason, its TPOT (decode_s spread over tokens after the first)
        and its speculation counters. TTFT is observed separately, when the first token arrives."""
        self.requests.labels(frontend=frontend, finish_reason=reason).inc()
        if decode_s is not None and num_output_tokens > 1:
            self.tpot.labels(frontend=frontend).observe(decode_s / (num_output_tokens - 1))
        if stats is None:
            return
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.verify_steps.inc(stats.verify_steps)
        for k, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position, strict=True)):
            self.drafted_per_position.labels(position=str(k)).inc(d)
            self.accepted_per_position.labels(position=str(k)).inc(a)


class EngineMetrics:
    """The engine-wide metrics (load, KV blocks, prefix cache, speculation kinds), brought up to date from the
    scheduler's state after a step, in `registry`."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "mtpserve") -> None:
        r = registry
        self.queue_depth = Gauge(f"{prefix}_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge(f"{prefix}_requests_running", "Requests holding a slot", registry=r)
        self.kv_usage = Gauge(f"{prefix}_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)
        self.kv_blocks_used = Gauge(f"{prefix}_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_cached = Gauge(
            f"{prefix}_kv_blocks_cached", "KV-cache blocks nobody holds, kept for prefix reuse", registry=r
        )
        self.prefix_query_tokens = Counter(
            f"{prefix}_prefix_cache_query_tokens", "Sequence tokens of admitted requests looked up", registry=r
        )
        self.prefix_hit_tokens = Counter(
            f"{prefix}_prefix_cache_hit_tokens", "Looked-up tokens whose KV came from the prefix cache", registry=r
        )
        self._prefix_seen = (0, 0)
        self.steps = Counter(f"{prefix}_engine_steps", "Engine steps run", registry=r)
        self.rows = Counter(
            f"{prefix}_engine_step_rows",
            "Target rows the steps computed (prompt tokens, decode tokens and their drafts); per step: / steps",
            registry=r,
        )
        self.preemptions = Counter(
            f"{prefix}_preemptions", "Requests preempted when KV blocks ran out (they recompute later)", registry=r
        )
        self.steps_launched = Counter(
            f"{prefix}_engine_steps_launched",
            "Engine steps launched on the device before the step ahead of them was read (the rest ran in turn)",
            registry=r,
        )
        self._step_counters = (self.steps, self.rows, self.preemptions, self.steps_launched)
        self._steps_seen = [0, 0, 0, 0]
        self.model = Gauge(
            f"{prefix}_model_info",
            "1, labelled with the served model (join on it to label the other series)",
            ["model_name", "dtype", "device", "tp_size", "draft_method", "num_draft_tokens"],
            registry=r,
        )
        self.steps_per_depth = Counter(
            f"{prefix}_spec_steps_per_depth",
            "Steps with generation rows by the kind they ran: a chain depth (0 = target-only, or the draft only "
            "keeps its KV), or tree<N> for a draft tree of N nodes",
            ["depth"],
            registry=r,
        )
        self.depth = Gauge(
            f"{prefix}_spec_depth",
            "Draft depth the steps run now: a fixed chain's K, or the adaptive policy's choice",
            registry=r,
        )
        self._kinds_seen: dict[str, int] = {}

    def observe_depths(self, steps_per_kind: dict[str, int], current: int) -> None:
        """Bring the per-kind step counters (keyed '0'..'K' and 'tree<N>') up to the policy's running totals,
        and set the depth gauge."""
        for kind, total in steps_per_kind.items():
            before = self._kinds_seen.get(kind, 0)
            self.steps_per_depth.labels(depth=kind).inc(max(0, total - before))
            self._kinds_seen[kind] = max(total, before)
        self.depth.set(current)

    def observe_load(self, running: int, waiting: int, blocks_used: int, blocks_total: int) -> None:
        """Set the load gauges."""
        self.running.set(running)
        self.queue_depth.set(waiting)
        self.kv_blocks_used.set(blocks_used)
        self.kv_usage.set(blocks_used / blocks_total if blocks_total else 0.0)

    def set_model(self, info: Any) -> None:
        """Label mtpserve_model_info with the served model (a ModelInfo message)."""
        draft = info.draft
        self.model.labels(
            model_name=info.model_name,
            dtype=info.dtype,
            device=info.device,
            tp_size=str(info.tp_size),
            draft_method=draft.method if draft.enabled else "none",
            num_draft_tokens=str(draft.num_draft_tokens if draft.enabled else 0),
        ).set(1)

    def observe_steps(self, steps: int, rows: int, preemptions: int, launched: int = 0) -> None:
        """Bring the step, row, preemption and launched-step counters up to the engine's running totals."""
        totals = (steps, rows, preemptions, launched)
        for key, (counter, total) in enumerate(zip(self._step_counters, totals, strict=True)):
            counter.inc(max(0, total - self._steps_seen[key]))
            self._steps_seen[key] = max(self._steps_seen[key], total)

    def observe_prefix_cache(self, query_tokens: int, hit_tokens: int, blocks_cached: int) -> None:
        """Bring the prefix-cache counters up to the scheduler's running totals, and set the cached gauge."""
        seen_q, seen_h = self._prefix_seen
        self.prefix_query_tokens.inc(max(0, query_tokens - seen_q))
        self.prefix_hit_tokens.inc(max(0, hit_tokens - seen_h))
        self._prefix_seen = (max(seen_q, query_tokens), max(seen_h, hit_tokens))
        self.kv_blocks_cached.set(blocks_cached)
