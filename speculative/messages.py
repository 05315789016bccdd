"""Per-step messages between scheduler, target workers and draft workers (in-process form).

Shapes are given per field: T = rows in the batch, B = sequences, K = draft tokens, V = vocab, d = hidden.
`workers/convert.py` maps each dataclass to its protobuf twin for the gRPC hops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtpserve.speculative.logits_processing import LogitsProcessing
from mtpserve.speculative.token_logprobs import TokenLogprobs


@dataclass
class SeqPlan:
    """One request's work in a step."""

    request_id: str
    token_ids: list[int]  # target input tokens: a context chunk, or [last token, d1..dK]
    start: int  # position of token_ids[0]: the request's context cursor
    block_ids: list[int]  # the request's KV block table
    is_context: bool  # context chunk (prompt, or prompt+output after preemption)
    is_final_chunk: bool  # the chunk reaches the end of the known sequence; generation rows: True
    lookahead_token: int  # sequence token at chunk end for a non-final context chunk, else -1
    num_draft_tokens: int = 0  # trailing drafts in token_ids (generation rows)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    draft_probs: torch.Tensor | None = None  # [num_draft_tokens, V] when sampling
    draft_parents: list[int] | None = None  # [num_draft_tokens] node each draft continues (0 = token_ids[0],
    # j = token_ids[j]); None: a chain, each draft continuing the one before
    processing: LogitsProcessing | None = None  # logit rules and logprobs (the step then runs eagerly)

    @property
    def end(self) -> int:
        """Position one past the last scheduled token."""
        return self.start + len(self.token_ids)


@dataclass
class StepPlan:
    """Everything the workers need for one step; context requests come first."""

    step_id: int
    seqs: list[SeqPlan]
    num_draft_tokens: int  # K for proposals this step (0 disables drafting); a tree's node budget
    finished_request_ids: list[str] = field(default_factory=list)  # workers drop their per-request state

    @property
    def num_tokens(self) -> int:
        """Target rows scheduled."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_chunks(self) -> int:
        """The context chunks that lead the plan (0 for a step of generation rows only)."""
        n = 0
        while n < len(self.seqs) and self.seqs[n].is_context:
            n += 1
        return n


@dataclass
class SeqResult:
    """What the target produced for one request in a step."""

    request_id: str
    new_token_ids: list[int]  # accepted drafts + bonus token, the first token, or [] mid-context
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: TokenLogprobs | None = None  # of new_token_ids, when the request asked for them


@dataclass
class DraftInputs:
    """Rows for the draft head: the target's input tokens and hidden states, per request."""

    step_id: int
    request_ids: list[str]  # [B]
    token_ids: torch.Tensor  # [T] int64 target input tokens (unshifted; accepted rows only)
    positions: torch.Tensor  # [T] int64
    seq_lens: list[int]  # [B] rows per request
    is_context: list[bool]  # [B]
    lookahead_tokens: torch.Tensor  # [C] int64, one per context request in order; -1 = final chunk
    sampled_tokens: torch.Tensor  # [B] int64 the target's token at each request's last row
    hidden_states: (
        torch.Tensor
    )  # [T, n*d] the draft head's target features (n = 1: hidden states before the final norm)
    block_ids: list[list[int]]  # [B] block tables
    propose: list[bool]  # [B] draft K tokens for this request (final chunk or generation)
    temperature: list[float]  # [B]
    top_p: list[float]  # [B]
    top_k: list[int]  # [B]
    seed: list[int | None]  # [B]
    num_draft_tokens: int = 0
    lookahead_source: str = "prompt"
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class DraftOutputs:
    """Draft proposals for the requests that asked for them."""

    step_id: int
    request_ids: list[str]  # [B'] proposing requests
    draft_token_ids: torch.Tensor  # [B', K] int64
    draft_probs: torch.Tensor | None = None  # [B', K, V] float32 when any request samples
    draft_parents: torch.Tensor | None = None  # [B', K] int64 trees: node each draft continues (0 = the root,
    # j = draft j); None for chains


@dataclass
class TargetOutput:
    """The target group's answer for a step: tokens per request, plus the draft's inputs."""

    step_id: int
    results: list[SeqResult]
    draft_inputs: DraftInputs | None = None  # for an in-process draft
    draft_outputs: DraftOutputs | None = None  # when the worker already ran the draft (colocated or remote)
    timing: dict[str, float] = field(default_factory=dict)
