"""Python client of the mtpserve gRPC API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc

FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "min_p",
    "logprobs",
    "stop",
    "include_stop_str_in_output",
    "json_object",
    "json_schema",
    "regex",
    "grammar",
)


def stats_dict(msg: pb.AcceptanceStats) -> dict[str, Any]:
    """AcceptanceStats as the `stats` object of the --json contract (same keys as SpecStats.to_dict)."""
    return {
        "drafted": msg.drafted,
        "accepted": msg.accepted,
        "verify_steps": msg.verify_steps,
        "acceptance_rate": round(msg.acceptance_rate, 6),
        "acceptance_length": round(msg.acceptance_length, 6),
        "accepted_per_position": [round(r, 6) for r in msg.accepted_per_position],
    }


def _joined(chunks: list[Chunk], logprobs: bool) -> dict[str, Any]:
    """One completion's chunks as the --json contract."""
    last = chunks[-1]
    out: dict[str, Any] = {
        "token_ids": [t for c in chunks for t in c.token_ids],
        "text": "".join(c.text for c in chunks),
        "finish_reason": last.finish_reason,
        "stats": last.stats,
    }
    if logprobs:
        out["logprobs"] = [e for c in chunks for e in c.logprobs]
    calls = [call for c in chunks for call in c.tool_calls]
    if calls:
        out["tool_calls"] = calls
    return out


@dataclass
class Chunk:
    """One streamed piece of a completion; the last one has finish_reason, usage and stats."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # per token: token_id, logprob, top
    index: int = 0  # which of the request's n completions
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # calls completed in this chunk: id, name, arguments

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Chunk:
        """Convert a GenerateResponse."""
        reason = FINISH_NAMES.get(msg.finish_reason, "unknown")
        chunk = cls(msg.request_id, msg.text, list(msg.token_ids), reason, index=msg.index)
        chunk.tool_calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in msg.tool_calls]
        chunk.logprobs = [
            {"token_id": e.token_id, "logprob": e.logprob, "top": [(t.token_id, t.logprob) for t in e.top]}
            for e in msg.logprobs
        ]
        if reason is not None:
            chunk.usage = {
                "prompt_tokens": msg.usage.prompt_tokens,
                "completion_tokens": msg.usage.completion_tokens,
            }
            chunk.stats = stats_dict(msg.stats)
        return chunk


@dataclass
class Chat:
    """A conversation prompt: turns as {"role", "content"} dicts (assistant turns may hold "tool_calls" as
    {"id", "name", "arguments"}, tool turns a "tool_call_id"), the tools the reply may call as {"name",
    "description", "parameters"} (a JSON schema), and the tool choice ("auto", "none", "required" or a name)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = ""

    def fill(self, req: pb.GenerateRequest) -> None:
        """Set the request's prompt, tools and tool choice."""
        for m in self.messages:
            calls = [pb.ToolCall(**c) for c in m.get("tool_calls") or []]
            turn = pb.ChatTurn(role=m["role"], content=m.get("content") or "", tool_calls=calls)
            turn.tool_call_id = m.get("tool_call_id", "")
            req.messages.turns.append(turn)
        for t in self.tools:
            params = json.dumps(t["parameters"]) if t.get("parameters") else ""
            req.tools.append(pb.Tool(name=t["name"], description=t.get("description", ""), parameters_json=params))
        req.tool_choice = self.tool_choice


def build_request(
    prompt: str | Chat | None = None,
    token_ids: list[int] | None = None,
    raw: bool = False,
    request_id: str = "",
    n: int = 1,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from a text prompt, a Chat or token ids plus SamplingParams fields (None = default)."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt or token_ids")
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}; known: {list(SAMPLING_FIELDS)}")
    req = pb.GenerateRequest(request_id=request_id, raw=raw, n=n)
    if isinstance(prompt, Chat):
        prompt.fill(req)
    elif prompt is not None:
        req.text = prompt
    else:
        req.token_ids.ids.extend(token_ids or [])
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop_token_ids", "stop"):
            getattr(req.sampling, name).extend(value)
        elif name == "logit_bias":
            req.sampling.logit_bias.update(value)
        else:
            setattr(req.sampling, name, value)
    req.sampling.SetInParent()
    return req


def _read(path: str | None) -> bytes | None:
    """A PEM file's bytes (None for None)."""
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class MTPServeClient:
    """A connection to an mtpserve server; `timeout` is the default deadline per call in seconds.

    auth_token: sent as `authorization: Bearer <token>` on every call. TLS is used when `tls` is true or any
    TLS file is given: `tls_ca_file` is the CA bundle that signed the server's certificate (None: the
    system's roots), `tls_cert_file` / `tls_key_file` the client certificate for mutual TLS.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = 300.0,
        max_message_mb: int = 256,
        *,
        auth_token: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        limit = max_message_mb * 1024 * 1024
        self.address = address
        self.timeout = timeout
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together (the client certificate and its key)")
        if tls or tls_ca_file or tls_cert_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file),
                private_key=_read(tls_key_file),
                certificate_chain=_read(tls_cert_file),
            )
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> MTPServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects; raises grpc.FutureTimeoutError after `timeout` seconds."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def stream(
        self,
        prompt: str | Chat | None = None,
        token_ids: list[int] | None = None,
        *,
        raw: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        n: int = 1,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Yield chunks as the server produces them (with n > 1 the completions' chunks interleave, each naming
        its `index`); closing the iterator early cancels the request."""
        req = build_request(prompt, token_ids, raw, request_id, n=n, **sampling)
        call = self.stub.Generate(req, timeout=timeout if timeout is not None else self.timeout, metadata=self.metadata)
        try:
            for msg in call:
                yield Chunk.from_proto(msg)
        finally:
            call.cancel()  # no-op once the stream has ended

    def generate(
        self,
        prompt: str | Chat | None = None,
        token_ids: list[int] | None = None,
        *,
        raw: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        n: int = 1,
        **sampling: Any,
    ) -> dict[str, Any]:
        """Run one request to the end; returns the --json contract: token_ids, text, finish_reason, stats (and,
        when asked for, logprobs: per token its id, logprob and top alternatives). With n > 1: {"choices": [one
        such dict per completion]}."""
        parts: dict[int, list[Chunk]] = {}
        call = self.stream(prompt, token_ids, raw=raw, request_id=request_id, timeout=timeout, n=n, **sampling)
        for chunk in call:
            parts.setdefault(chunk.index, []).append(chunk)
        if len(parts) != n or any(chunks[-1].finish_reason is None for chunks in parts.values()):
            raise RuntimeError("the server closed the stream without a final message for every completion")
        choices = [_joined(parts[i], sampling.get("logprobs") is not None) for i in range(n)]
        return choices[0] if n == 1 else {"choices": choices}

    def abort(self, request_id: str) -> bool:
        """Stop a request; True if it was in flight."""
        return bool(
            self.stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
            ).aborted
        )

    def model_info(self) -> dict[str, Any]:
        """The served model and draft head, as a dict with the proto's field names."""
        msg = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)
        return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def stats(self) -> dict[str, Any]:
        """Aggregate acceptance statistics, load and KV-cache use."""
        msg = self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout, metadata=self.metadata)
        return {
            "totals": stats_dict(msg.totals),
            "requests_running": msg.requests_running,
            "requests_waiting": msg.requests_waiting,
            "kv_blocks_used": msg.kv_blocks_used,
            "kv_blocks_total": msg.kv_blocks_total,
            "requests_finished": msg.requests_finished,
            "generated_tokens": msg.generated_tokens,
            "uptime_s": msg.uptime_s,
            "kv_blocks_cached": msg.kv_blocks_cached,
            "prefix_cache_query_tokens": msg.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": msg.prefix_cache_hit_tokens,
            "prefix_cache_hit_rate": msg.prefix_cache_hit_rate,
        }

    def health(self, service: str = "") -> str:
        """grpc.health.v1 status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
