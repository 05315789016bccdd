"""Service configuration: pydantic models loadable from YAML and overridable by CLI flags.

It sits with the worker runtimes because the worker actors and builders are made from it; the cluster
layer above reads it as well.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mtpserve.modeling.gemv_tiles import parse_table

MAX_STEPS_AHEAD = 2  # steps launched on the device ahead of the one being read (host buffers rotate over one more)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Which target model to load and where it runs."""

    path: str | None = Field(
        None,
        description="HF Llama-family (Llama, Mistral, Qwen2, Qwen3) or DeepSeek-V3 directory, or a .gguf file; None "
        "loads the default SmolLM2-135M-Instruct",
    )
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = Field(
        "auto",
        description="auto: from the path; dummy: random weights of the checkpoint's shape (DeepSeek-V3: made in "
        "place on the device, so real shapes need no host copy)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations; auto: bfloat16 on CUDA, float32 on the CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs; auto: CUDA if visible")
    max_model_len: int | None = Field(None, gt=0, description="cap on prompt + output tokens")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the process that runs the model on the CPU; None: half the cores (at least 1), "
        "leaving the rest to the front ends and tokenizers (more threads than cores slows every step several times)",
    )
    warm_up: bool = Field(
        True,
        description="on CUDA, before `serve` reports SERVING, run throw-away requests through the steps serving meets "
        "first (a burst of prompts, prompts beside decode rows), so that no client waits for kernels to compile",
    )
    cache_dir: str | None = Field(None, description="where converted safetensors are cached")
    seed: int = Field(0, description="seed of random weights and heads (load_format dummy, draft random)")
    cuda_graphs: bool = Field(True, description="capture generation steps in CUDA graphs (CUDA only)")
    overlap_steps: bool = Field(
        True,
        description="decoding on captured steps: queue the next step before reading this one's tokens, so "
        "host work overlaps GPU work",
    )
    overlap_speculative: bool = Field(
        True,
        description="overlap speculative steps too (draft fused into the target's step: in process, or a TP=1 Ray rank "
        "with the draft colocated); needs overlap_steps",
    )
    steps_ahead: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS_AHEAD,
        description="overlapped decoding: how many steps are launched on the device ahead of the one whose tokens "
        "are read; None picks 1 in process and 2 over Ray ranks, where the plan's round trip to the ranks must "
        "fit in the steps launched ahead",
    )
    fused_steps: bool = Field(
        True,
        description="fold a draft that runs in the target's process into the target's captured steps (the fused "
        "chain steps, the tree step); false: the draft's chain is captured apart, as on a separate draft worker "
        "(to compare the two; CUDA graphs)",
    )
    fused_kernels: bool = Field(
        True,
        description="fused Triton kernels (CUDA only): norm+residual, RoPE+KV write, SwiGLU, and for small steps "
        "matrix-vector projections, greedy tokens without logits and the MTP head's input in one launch",
    )
    prefill_graphs: bool = Field(
        True,
        description="capture a step that holds one greedy prompt chunk, target and colocated draft chain "
        "together, per chunk-length bucket up to scheduler.chunk_size (CUDA graphs, TP=1, in process)",
    )
    pdl: bool = Field(
        True,
        description="launch the small-step Triton kernels with programmatic dependent launch (Hopper and newer): "
        "each kernel reads its weights while the previous one finishes; process-wide",
    )
    gemv_tiles: str = Field(
        "auto",
        description="tiles of the small-step matrix-vector kernels by row count: auto (the table measured on this "
        "GPU model, else the defaults), default, or a table such as 1=8x0,2=8x0r,4=4x2g2,16=8x0g4 (output "
        "columns x warps per program, r: rows reduced one at a time, gN: N rows per program, which lets steps of "
        "8-32 rows take the kernels; modeling/gemv_tiles.py); process-wide",
    )

    @field_validator("gemv_tiles")
    @classmethod
    def _tiles_table(cls, value: str) -> str:
        if value not in ("auto", "default"):
            parse_table(value)
        return value

    def launched_ahead(self, remote: bool) -> int:
        """Steps launched ahead of the one being read: `steps_ahead`, else 2 for Ray ranks and 1 in process."""
        return self.steps_ahead or (2 if remote else 1)


def cpu_threads(m: ModelConfig) -> int:
    """Torch threads for a model on the CPU: `cpu_threads`, or half the cores (at least 1)."""
    return m.cpu_threads if m.cpu_threads is not None else max(1, (os.cpu_count() or 1) // 2)


class SpeculativeConfig(_Strict):
    """MTP Eagle draft settings."""

    enabled: bool = Field(True, description="speculative decoding with a draft head; false: target-only decoding")
    draft: str | None = Field(
        "default",
        description="'default' (the shipped head, or the checkpoint's own MTP modules where it has them), "
        "'native' (the checkpoint's MTP modules), 'random' (untrained, tests only), a safetensors path (an MTP "
        "Eagle head), an EAGLE-3 checkpoint directory (method 'eagle3'), or None",
    )
    method: Literal["mtp_eagle", "eagle3", "mtp_vanilla"] = Field(
        "mtp_eagle",
        description="'mtp_eagle': one MTP module reused for every draft position; 'eagle3': an EAGLE-3 head "
        "(SpecForge / SGLang / vLLM speculators checkpoint) reused the same way; 'mtp_vanilla': module j "
        "drafts position j+1 (needs num_draft_tokens native MTP modules)",
    )
    num_draft_tokens: int = Field(3, ge=1, le=8, description="draft tokens per step; with trees, the tree depth")
    lookahead_source: Literal["prompt", "sampled"] = Field(
        "prompt", description="'sampled' reproduces the pre-fix chunked-prefill bug, for ablation only"
    )
    tree_budget: int = Field(
        0,
        ge=0,
        le=63,
        description="draft-tree nodes per request and step (EAGLE-2 style, depth num_draft_tokens); 0: a linear chain",
    )
    tree_width: int = Field(4, ge=1, le=16, description="children per expanded tree node, and nodes expanded per level")
    draft_vocab: int = Field(
        0,
        ge=0,
        description="with draft 'random': its lm_head scores only the first N token ids (0: all), to time a "
        "reduced draft vocabulary (`train-draft --stage vocab`) at any shape",
    )
    adaptive: bool = Field(
        True,
        description="choose each step's chain depth in [0, num_draft_tokens] from the batch size, the measured "
        "step cost and the running acceptance per position (depth 0 keeps the draft's KV current, drafts "
        "nothing); with tree_budget set (above num_draft_tokens), the draft tree is a candidate too. On by "
        "default where it applies (method 'mtp_eagle' or 'eagle3', a tree budget above num_draft_tokens if "
        "any); false: every step drafts num_draft_tokens (or the tree)",
    )

    @model_validator(mode="after")
    def _check_tree(self) -> SpeculativeConfig:
        if self.draft_vocab and self.draft != "random":
            raise ValueError("draft_vocab: applies to draft 'random' only (a trained head carries its own vocabulary)")
        cannot = self.method == "mtp_vanilla" or 0 < self.tree_budget <= self.num_draft_tokens
        if self.adaptive and cannot and "adaptive" not in self.model_fields_set:
            object.__setattr__(self, "adaptive", False)  # left unset: off where it cannot apply (no re-validation)
        if self.adaptive and self.method == "mtp_vanilla":
            raise ValueError(
                "adaptive: chooses among the chains (and trees) of one reused head (method 'mtp_eagle' or 'eagle3')"
            )
        if self.adaptive and self.tree_budget and self.tree_budget <= self.num_draft_tokens:
            raise ValueError(
                f"tree_budget: with adaptive, a tree needs more nodes ({self.tree_budget}) than the deepest chain "
                f"has drafts (num_draft_tokens {self.num_draft_tokens}), so that a step's draft count names its kind"
            )
        if self.tree_budget:
            if self.method == "mtp_vanilla":
                raise ValueError(
                    "tree_budget: draft trees reuse one MTP module or EAGLE-3 head (speculative.method 'mtp_eagle' or "
                    "'eagle3')"
                )
            if (self.num_draft_tokens - 1) * self.tree_width > 64:
                raise ValueError(
                    f"tree_width: (num_draft_tokens - 1) x tree_width = {(self.num_draft_tokens - 1) * self.tree_width}"
                    " frontier rows; the attention kernels' tree masks cover at most 64"
                )
            if self.tree_budget > self.tree_candidates:
                raise ValueError(
                    f"tree_budget: {self.tree_budget} exceeds the {self.tree_candidates} nodes a tree of depth "
                    f"{self.num_draft_tokens} and width {self.tree_width} grows"
                )
        return self

    @property
    def tree_candidates(self) -> int:
        """Nodes a tree grows before it is pruned to its budget."""
        return self.tree_width + (self.num_draft_tokens - 1) * self.tree_width**2

    @property
    def proposed_tokens(self) -> int:
        """Draft tokens one proposal carries: the tree budget, or the chain's K."""
        return self.tree_budget or self.num_draft_tokens

    @property
    def scratch_slots(self) -> int:
        """KV slots past a request's tokens that drafting writes: a chain's next drafts, a tree's frontier rows."""
        if self.tree_budget:
            return max(1, (self.num_draft_tokens - 1) * self.tree_width)  # at least K: an adaptive tree's chains
        return self.num_draft_tokens


ADMIT_WAIT_MS = 8.0  # how long an arrival may wait to join a batch on launched steps, by default
PREFILL_SHARE = 8192  # prompt tokens a step may take beside a full decode batch, by default (vLLM's on large GPUs)


class SchedulerConfig(_Strict):
    """Context-chunk scheduling and KV-cache limits."""

    max_num_batched_tokens: int = Field(
        64 * 4 + PREFILL_SHARE,
        gt=0,
        description="rows one step computes: decode rows with their drafts first, prompt chunks in what is left. "
        "Unset, it is sized so that a full decode batch never starves and a burst of prompts prefills in few steps: "
        f"max_num_requests x (draft tokens + 1) + max(chunk_size, {PREFILL_SHARE}) (8,448 for 64 requests at K=3)",
    )
    chunk_size: int = Field(512, gt=0, description="max prompt tokens one request computes per step")
    max_num_requests: int = Field(64, gt=0, description="concurrent running requests (slots)")
    block_size: int = Field(16, gt=0, description="tokens per KV-cache block (and per prefix-cache key)")
    num_kv_blocks: int | None = Field(None, gt=0, description="None sizes the cache from max_num_requests")
    max_queue: int = Field(1024, gt=0, description="waiting requests before RESOURCE_EXHAUSTED")
    admit_wait_ms: float = Field(
        ADMIT_WAIT_MS,
        ge=0,
        description="while steps are launched ahead, requests that arrive wait up to this long to join the batch "
        "together (or until they are an eighth of it), since each join adds a prefill replay to a step; "
        "0 joins each at the next step",
    )
    join_ahead: bool = Field(
        True,
        description="arriving requests whose whole prompt fits one chunk join in a step launched ahead, their "
        "prompts replayed beside the decode rows; off, or for longer prompts, each join first reads the launched "
        "steps and runs a step in turn",
    )
    prefix_caching: bool = Field(
        True,
        description="reuse the target and draft KV of full blocks whose tokens (and next token) an earlier "
        "request computed",
    )


class ParallelConfig(_Strict):
    """Tensor parallelism and actor placement."""

    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks of the target (through Ray actors when > 1)")
    draft_placement: Literal["separate", "colocated"] = Field(
        "colocated", description="the draft head inside target rank 0 (colocated) or in a worker of its own"
    )
    distributed: bool = Field(False, description="run through Ray actors even at tp_size 1")
    step_transport: Literal["auto", "grpc"] = Field(
        "auto",
        description="how steps reach the target ranks: auto = a Unix socket to ranks on the scheduler's node "
        "and a gRPC stream to others; grpc = the gRPC stream to every rank",
    )
    ray_address: str | None = Field(None, description="an existing Ray cluster to join; None: start a local one")
    step_timeout_s: float = Field(
        120.0, gt=0, description="a worker step (or draft hop) taking longer counts as a stalled worker: restart"
    )

    @property
    def uses_ray(self) -> bool:
        """True when this asks for Ray actors: tp_size > 1, `distributed`, or a Ray address."""
        return self.tp_size > 1 or self.distributed or self.ray_address is not None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class TLSConfig(_Strict):
    """TLS on the public gRPC and HTTP ports: a server certificate, and client certificates when a CA is given."""

    cert_file: str | None = Field(None, description="PEM certificate chain of the server")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    client_ca_file: str | None = Field(None, description="PEM CA bundle; set: clients must present a certificate")

    @model_validator(mode="after")
    def _check_pairs(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("server.tls.cert_file and server.tls.key_file must be given together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("server.tls.client_ca_file (mutual TLS) needs server.tls.cert_file and key_file")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the port speaks TLS."""
        return self.cert_file is not None


class ServerConfig(_Strict):
    """Public gRPC, OpenAI-compatible HTTP and metrics endpoints, and who may call them."""

    host: str = Field("127.0.0.1", description="bind address; other than loopback needs TLS or a token")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one")
    metrics_host: str = Field(
        "127.0.0.1",
        description="bind address of /metrics (no token, no TLS): loopback by default, so that serving on 0.0.0.0 "
        "does not expose it; 0.0.0.0 for a scraper on another host (a Kubernetes PodMonitor)",
    )
    metrics_auth_token_file: str | None = Field(
        None,
        description="file holding a bearer token that /metrics requires (a scraper's `authorization` header); None: "
        "open, so keep metrics_host on loopback or a trusted network",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on "
        "this port, same host, TLS and token as gRPC; 0 picks a free port; None: off",
    )
    http_max_body_mb: int = Field(4, gt=0, description="largest HTTP request body; a larger one gets 413")
    idle_timeout_s: float = Field(
        15.0,
        gt=0.0,
        description="a connection that has not sent a whole request (HTTP headers, or gRPC's handshake) this long "
        "after it opened or after its last request, is closed; so is a gRPC connection without a call",
    )
    body_timeout_s: float = Field(30.0, gt=0.0, description="an HTTP request body not all sent this long gets 408")
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open connections each front-end process keeps on each port; at the cap a new HTTP connection "
        "closes the oldest idle one (503 when all are busy) and gRPC stops accepting; None: half of the open-file "
        "limit after a reserve of 256, so the two ports never run the process out of files",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0.0,
        description="on SIGTERM: refuse new requests and let those in flight finish for up to this long, then end "
        "the rest with a terminal error (Kubernetes' terminationGracePeriodSeconds should exceed it)",
    )
    max_message_mb: int = Field(
        256,
        gt=0,
        description="largest gRPC message out; in, the largest a request of max_model_len tokens needs (at least 1 "
        "MB), if smaller",
    )
    max_connection_age_s: float | None = Field(
        3600.0,
        gt=0.0,
        description="a gRPC connection this old is asked to reconnect (its calls in flight finish), so that "
        "long-lived clients spread over the replicas behind a load balancer; None: never",
    )
    tls: TLSConfig = TLSConfig()
    auth_token_file: str | None = Field(
        None,
        description="file holding the bearer token every Inference call and HTTP API call must carry (health is open)",
    )
    allow_insecure: bool = Field(False, description="serve a non-loopback address without TLS and without a token")
    engine_process: bool = Field(
        True,
        description="run the engine and the front ends in separate processes: without Ray the engine in a child "
        "of `mtpserve serve`, with Ray the front ends in a child of the scheduler actor; false: one process",
    )

    frontends: int | None = Field(
        None,
        ge=1,
        le=64,
        description="front-end processes serving gRPC and HTTP on the same ports (SO_REUSEPORT), each tokenizing, "
        "detokenizing and streaming its own requests, beside the engine's process (or every replica's, routing "
        "over all); None: one per 4 cores, at most 4 (with engine_process; with Ray, beside the scheduler actor)",
    )

    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="engines behind the one endpoint, each in a process of its own with its own KV cache (on this "
        "node, with engine_process); a request goes to one by `routing`",
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        le=64,
        description="grow the replica set up to this many while requests wait at every replica for "
        "`scale_hold_s`, and shrink it back to `replicas` when they would fit fewer (a replica leaving finishes its "
        "streams first); None: `replicas`, fixed",
    )
    scale_up_waiting: int = Field(4, ge=1, description="waiting requests per replica that ask for one more replica")
    scale_hold_s: float = Field(10.0, ge=0.0, description="how long a scaling condition holds before it acts")
    routing: Literal["prefix", "round_robin"] = Field(
        "prefix",
        description="how requests are spread over the replicas: 'prefix' sends each to the replica that holds the "
        "longest cached prefix of its prompt unless that one is much busier (then the less loaded of two drawn at "
        "random); 'round_robin' takes them in turn",
    )

    @property
    def most_replicas(self) -> int:
        """The most replicas the set may hold: `max_replicas`, or `replicas`."""
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def num_frontends(self) -> int:
        """Front-end processes to run: `frontends`, or one per 4 cores (1 to 4)."""
        if self.frontends is not None:
            return self.frontends
        return max(1, min(4, (os.cpu_count() or 1) // 4))

    @model_validator(mode="after")
    def _check_exposure(self) -> ServerConfig:
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError(f"server.http_port {self.http_port} is already server.port or server.metrics_port")
        secured = self.tls.enabled or self.auth_token_file is not None
        if self.host not in LOOPBACK_HOSTS and not secured and not self.allow_insecure:
            raise ValueError(
                f"server.host {self.host!r} is reachable from other machines: set server.auth_token_file and/or "
                "server.tls, or server.allow_insecure: true to serve it open"
            )
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"server.max_replicas {self.max_replicas} is below server.replicas {self.replicas}")
        if self.most_replicas > 1 and not self.engine_process:
            raise ValueError(
                "server.replicas > 1 runs each replica's engine in a process of its own: keep server.engine_process"
            )
        return self


class MTPServeConfig(_Strict):
    """The whole service configuration."""

    model: ModelConfig = ModelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _check_budget(self) -> MTPServeConfig:
        k = self.speculative.proposed_tokens if self.speculative.enabled else 0
        sched = self.scheduler
        if "max_num_batched_tokens" not in sched.model_fields_set:
            sched.max_num_batched_tokens = sched.max_num_requests * (k + 1) + max(sched.chunk_size, PREFILL_SHARE)
            sched.model_fields_set.discard("max_num_batched_tokens")  # still derived: a re-validation sizes it again
        if self.scheduler.max_num_batched_tokens < k + 1:
            what = "tree_budget" if self.speculative.tree_budget else "num_draft_tokens"
            raise ValueError(f"scheduler.max_num_batched_tokens must be at least speculative.{what} + 1")
        return self

    @property
    def prefix_caching(self) -> bool:
        """Whether the scheduler reuses cached blocks. Off under lookahead_source 'sampled': that ablation
        must reproduce the pre-fix draft cache of each chunking, which shared blocks would hide. Off under
        vanilla MTP with several modules: module j's last rows of a block depend on j+1 tokens after it,
        more than a block key covers."""
        return (
            self.scheduler.prefix_caching
            and self.speculative.lookahead_source == "prompt"
            and not (self.speculative.method == "mtp_vanilla" and self.speculative.num_draft_tokens > 1)
        )

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> MTPServeConfig:
        """Load a YAML file, then apply dotted-key overrides such as {"parallel.tp_size": 2}."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        return cls.from_dict(data, overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: dict[str, Any] | None = None) -> MTPServeConfig:
        """Build from nested dicts plus dotted-key overrides (None values are skipped)."""
        merged: dict[str, Any] = copy.deepcopy(data)
        for dotted, value in (overrides or {}).items():
            if value is None:
                continue
            *path, key = dotted.split(".")
            node = merged
            for part in path:  # nested sections too: server.tls.cert_file
                node = node.setdefault(part, {})
            node[key] = value
        return cls.model_validate(merged)
