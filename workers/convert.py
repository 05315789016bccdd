"""Conversions between the step dataclasses (speculative/messages.py) and their protobuf twins (worker.proto)."""

from __future__ import annotations

import torch

from mtpserve.proto.codec import decode_tensor, encode_tensor
from mtpserve.proto.mtpserve.v1 import worker_pb2 as wpb
from mtpserve.speculative.logits_processing import LogitsProcessing
from mtpserve.speculative.messages import DraftInputs, DraftOutputs, SeqPlan, SeqResult, StepPlan, TargetOutput
from mtpserve.speculative.token_logprobs import TokenLogprobs
from mtpserve.workers.message_checks import InvalidStepMessage
from mtpserve.workers.wire_columns import (
    plain_results,
    plain_rows,
    plan_columns,
    result_columns,
    results_from_columns,
    seqs_from_columns,
)

TIMELINE = ("decode_s", "worker_s", "t_received", "t_queued", "t_done", "t_replied")  # StepTiming's rank-0 figures


def plan_to_proto(plan: StepPlan, columns: bool = True) -> wpb.StepPlan:
    """StepPlan -> wire: its rows as columns when they fit them (`columns`) and as row messages otherwise."""
    if columns and plain_rows(plan.seqs):
        return wpb.StepPlan(
            step_id=plan.step_id,
            columns=plan_columns(plan.seqs),
            num_draft_tokens=plan.num_draft_tokens,
            finished_request_ids=plan.finished_request_ids,
        )
    seqs = []
    for s in plan.seqs:
        m = wpb.SeqPlan(
            request_id=s.request_id,
            token_ids=s.token_ids,
            start=s.start,
            block_ids=s.block_ids,
            is_context=s.is_context,
            is_final_chunk=s.is_final_chunk,
            lookahead_token=s.lookahead_token,
            num_draft_tokens=s.num_draft_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
        )
        if s.seed is not None:
            m.seed = s.seed
        if s.draft_probs is not None:
            m.draft_probs.CopyFrom(encode_tensor(s.draft_probs))
        if s.draft_parents is not None:
            m.draft_parents.extend(s.draft_parents)
        if s.processing is not None:
            m.processing.CopyFrom(processing_to_proto(s.processing))
        seqs.append(m)
    return wpb.StepPlan(
        step_id=plan.step_id,
        seqs=seqs,
        num_draft_tokens=plan.num_draft_tokens,
        finished_request_ids=plan.finished_request_ids,
    )


def plan_from_proto(m: wpb.StepPlan) -> StepPlan:
    """Wire -> StepPlan (InvalidStepMessage for columns that do not hold together, or a plan with both forms)."""
    if m.HasField("columns"):
        if m.seqs:
            raise InvalidStepMessage("columns", "a plan sends its rows as seqs or as columns, not both")
        return StepPlan(m.step_id, seqs_from_columns(m.columns), m.num_draft_tokens, list(m.finished_request_ids))
    seqs = [
        SeqPlan(
            request_id=s.request_id,
            token_ids=list(s.token_ids),
            start=s.start,
            block_ids=list(s.block_ids),
            is_context=s.is_context,
            is_final_chunk=s.is_final_chunk,
            lookahead_token=s.lookahead_token,
            num_draft_tokens=s.num_draft_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            draft_probs=decode_tensor(s.draft_probs) if s.HasField("draft_probs") else None,
            draft_parents=list(s.draft_parents) or None,
            processing=processing_from_proto(s.processing) if s.HasField("processing") else None,
        )
        for s in m.seqs
    ]
    return StepPlan(m.step_id, seqs, m.num_draft_tokens, list(m.finished_request_ids))


def processing_to_proto(p: LogitsProcessing) -> wpb.LogitsProcessing:
    """LogitsProcessing -> wire."""
    m = wpb.LogitsProcessing(
        output_token_ids=p.output_token_ids,
        prompt_token_ids=p.prompt_token_ids,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=p.logit_bias,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        min_p=p.min_p,
        logprobs=p.logprobs,
    )
    if p.allowed is not None:
        m.allowed.CopyFrom(encode_tensor(p.allowed))
    return m


def processing_from_proto(m: wpb.LogitsProcessing) -> LogitsProcessing:
    """Wire -> LogitsProcessing."""
    return LogitsProcessing(
        output_token_ids=list(m.output_token_ids),
        prompt_token_ids=list(m.prompt_token_ids),
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty,
        logit_bias=dict(m.logit_bias),
        min_tokens=m.min_tokens,
        stop_token_ids=list(m.stop_token_ids),
        min_p=m.min_p,
        logprobs=m.logprobs,
        allowed=decode_tensor(m.allowed) if m.HasField("allowed") else None,
    )


def logprobs_to_proto(lp: TokenLogprobs) -> wpb.TokenLogprobs:
    """TokenLogprobs -> wire."""
    top = [wpb.TopLogprobs(token_ids=i, logprobs=v) for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
    return wpb.TokenLogprobs(token_logprobs=lp.token_logprobs, top=top)


def logprobs_from_proto(m: wpb.TokenLogprobs) -> TokenLogprobs:
    """Wire -> TokenLogprobs."""
    return TokenLogprobs(list(m.token_logprobs), [list(t.token_ids) for t in m.top], [list(t.logprobs) for t in m.top])


def draft_inputs_to_proto(d: DraftInputs) -> wpb.DraftInputs:
    """DraftInputs -> wire (hidden states keep their dtype)."""
    seeds = [wpb.OptionalSeed(value=s) if s is not None else wpb.OptionalSeed() for s in d.seed]
    return wpb.DraftInputs(
        step_id=d.step_id,
        request_ids=d.request_ids,
        token_ids=encode_tensor(d.token_ids),
        positions=encode_tensor(d.positions),
        seq_lens=d.seq_lens,
        is_context=d.is_context,
        lookahead_tokens=encode_tensor(d.lookahead_tokens),
        sampled_tokens=encode_tensor(d.sampled_tokens),
        hidden_states=encode_tensor(d.hidden_states),
        block_ids=[wpb.BlockTable(ids=b) for b in d.block_ids],
        propose=d.propose,
        temperature=d.temperature,
        top_p=d.top_p,
        top_k=d.top_k,
        seed=seeds,
        num_draft_tokens=d.num_draft_tokens,
        lookahead_source=d.lookahead_source,
        finished_request_ids=d.finished_request_ids,
    )


def draft_inputs_from_proto(m: wpb.DraftInputs, device: torch.device | str = "cpu") -> DraftInputs:
    """Wire -> DraftInputs (hidden states land on `device`)."""
    return DraftInputs(
        step_id=m.step_id,
        request_ids=list(m.request_ids),
        token_ids=decode_tensor(m.token_ids),
        positions=decode_tensor(m.positions),
        seq_lens=list(m.seq_lens),
        is_context=list(m.is_context),
        lookahead_tokens=decode_tensor(m.lookahead_tokens),
        sampled_tokens=decode_tensor(m.sampled_tokens),
        hidden_states=decode_tensor(m.hidden_states, device),
        block_ids=[list(b.ids) for b in m.block_ids],
        propose=list(m.propose),
        temperature=list(m.temperature),
        top_p=list(m.top_p),
        top_k=list(m.top_k),
        seed=[s.value if s.HasField("value") else None for s in m.seed],
        num_draft_tokens=m.num_draft_tokens,
        lookahead_source=m.lookahead_source or "prompt",
        finished_request_ids=list(m.finished_request_ids),
    )


def draft_outputs_to_proto(d: DraftOutputs) -> wpb.DraftOutputs:
    """DraftOutputs -> wire."""
    m = wpb.DraftOutputs(step_id=d.step_id, request_ids=d.request_ids, draft_token_ids=encode_tensor(d.draft_token_ids))
    if d.draft_probs is not None:
        m.draft_probs.CopyFrom(encode_tensor(d.draft_probs))
    if d.draft_parents is not None:
        m.draft_parents.CopyFrom(encode_tensor(d.draft_parents))
    return m


def draft_outputs_from_proto(m: wpb.DraftOutputs) -> DraftOutputs:
    """Wire -> DraftOutputs."""
    probs = decode_tensor(m.draft_probs) if m.HasField("draft_probs") else None
    parents = decode_tensor(m.draft_parents) if m.HasField("draft_parents") else None
    return DraftOutputs(m.step_id, list(m.request_ids), decode_tensor(m.draft_token_ids), probs, draft_parents=parents)


def target_output_to_proto(o: TargetOutput) -> wpb.TargetOutput:
    """TargetOutput -> wire (DraftInputs never travel back to the driver)."""
    plain = plain_results(o.results)
    m = wpb.TargetOutput(
        step_id=o.step_id,
        columns=result_columns(o.results) if plain else None,
        results=[]
        if plain
        else [
            wpb.SeqResult(
                request_id=r.request_id,
                new_token_ids=r.new_token_ids,
                num_drafted=r.num_drafted,
                num_accepted=r.num_accepted,
                logprobs=None if r.logprobs is None else logprobs_to_proto(r.logprobs),
            )
            for r in o.results
        ],
        timing=wpb.StepTiming(
            target_s=o.timing.get("target_s", 0.0),
            draft_hop_s=o.timing.get("draft_hop_s", 0.0),
            draft_inputs_bytes=int(o.timing.get("draft_inputs_bytes", 0)),
            draft_outputs_bytes=int(o.timing.get("draft_outputs_bytes", 0)),
            **{key: o.timing.get(key, 0.0) for key in TIMELINE},
        ),
    )
    if o.draft_outputs is not None:
        m.draft_outputs.CopyFrom(draft_outputs_to_proto(o.draft_outputs))
    return m


def target_output_from_proto(m: wpb.TargetOutput) -> TargetOutput:
    """Wire -> TargetOutput."""
    results = results_from_columns(m.columns) if m.HasField("columns") else []
    results += [
        SeqResult(
            r.request_id,
            list(r.new_token_ids),
            r.num_drafted,
            r.num_accepted,
            logprobs=logprobs_from_proto(r.logprobs) if r.HasField("logprobs") else None,
        )
        for r in m.results
    ]
    drafts = draft_outputs_from_proto(m.draft_outputs) if m.HasField("draft_outputs") else None
    t = m.timing
    timing = {
        "target_s": t.target_s,
        "draft_hop_s": t.draft_hop_s,
        "draft_inputs_bytes": float(t.draft_inputs_bytes),
        "draft_outputs_bytes": float(t.draft_outputs_bytes),
        **{key: getattr(t, key) for key in TIMELINE},
    }
    return TargetOutput(m.step_id, results, None, drafts, timing=timing)
