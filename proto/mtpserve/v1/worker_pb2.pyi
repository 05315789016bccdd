from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SeqPlan(_message.Message):
    __slots__ = ("request_id", "token_ids", "start", "block_ids", "is_context", "is_final_chunk", "lookahead_token", "num_draft_tokens", "temperature", "top_p", "top_k", "seed", "draft_probs", "draft_parents", "processing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    is_context: bool
    is_final_chunk: bool
    lookahead_token: int
    num_draft_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    draft_probs: Tensor
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    processing: LogitsProcessing
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., is_context: _Optional[bool] = ..., is_final_chunk: _Optional[bool] = ..., lookahead_token: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., processing: _Optional[_Union[LogitsProcessing, _Mapping]] = ...) -> None: ...

class LogitsProcessing(_message.Message):
    __slots__ = ("output_token_ids", "prompt_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "min_p", "logprobs", "allowed")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_p: float
    logprobs: int
    allowed: Tensor
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., allowed: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_logprobs", "top")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "seqs", "num_draft_tokens", "finished_request_ids", "columns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqPlan]
    num_draft_tokens: int
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    columns: PlanColumns
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqPlan, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., columns: _Optional[_Union[PlanColumns, _Mapping]] = ...) -> None: ...

class PlanColumns(_message.Message):
    __slots__ = ("request_ids", "starts", "token_counts", "token_ids", "block_counts", "block_ids", "flags", "lookahead_tokens", "num_draft_tokens", "temperatures", "top_ps", "top_ks")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    TOP_PS_FIELD_NUMBER: _ClassVar[int]
    TOP_KS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    starts: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_counts: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    flags: _containers.RepeatedScalarFieldContainer[int]
    lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    temperatures: _containers.RepeatedScalarFieldContainer[float]
    top_ps: _containers.RepeatedScalarFieldContainer[float]
    top_ks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., starts: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_counts: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., flags: _Optional[_Iterable[int]] = ..., lookahead_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., temperatures: _Optional[_Iterable[float]] = ..., top_ps: _Optional[_Iterable[float]] = ..., top_ks: _Optional[_Iterable[int]] = ...) -> None: ...

class SeqResult(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "num_drafted", "num_accepted", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: int
    num_accepted: int
    logprobs: TokenLogprobs
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class DraftInputs(_message.Message):
    __slots__ = ("step_id", "request_ids", "token_ids", "positions", "seq_lens", "is_context", "lookahead_tokens", "sampled_tokens", "hidden_states", "block_ids", "propose", "temperature", "top_p", "top_k", "seed", "num_draft_tokens", "lookahead_source", "finished_request_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    IS_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: Tensor
    positions: Tensor
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    is_context: _containers.RepeatedScalarFieldContainer[bool]
    lookahead_tokens: Tensor
    sampled_tokens: Tensor
    hidden_states: Tensor
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockTable]
    propose: _containers.RepeatedScalarFieldContainer[bool]
    temperature: _containers.RepeatedScalarFieldContainer[float]
    top_p: _containers.RepeatedScalarFieldContainer[float]
    top_k: _containers.RepeatedScalarFieldContainer[int]
    seed: _containers.RepeatedCompositeFieldContainer[OptionalSeed]
    num_draft_tokens: int
    lookahead_source: str
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., positions: _Optional[_Union[Tensor, _Mapping]] = ..., seq_lens: _Optional[_Iterable[int]] = ..., is_context: _Optional[_Iterable[bool]] = ..., lookahead_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., sampled_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., block_ids: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., propose: _Optional[_Iterable[bool]] = ..., temperature: _Optional[_Iterable[float]] = ..., top_p: _Optional[_Iterable[float]] = ..., top_k: _Optional[_Iterable[int]] = ..., seed: _Optional[_Iterable[_Union[OptionalSeed, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ..., lookahead_source: _Optional[str] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OptionalSeed(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class DraftOutputs(_message.Message):
    __slots__ = ("step_id", "request_ids", "draft_token_ids", "draft_probs", "draft_parents", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    draft_token_ids: Tensor
    draft_probs: Tensor
    draft_parents: Tensor
    error: StepError
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., draft_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ..., draft_parents: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("target_s", "draft_hop_s", "draft_inputs_bytes", "draft_outputs_bytes", "decode_s", "worker_s", "t_received", "t_queued", "t_done", "t_replied")
    TARGET_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HOP_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_INPUTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_OUTPUTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_S_FIELD_NUMBER: _ClassVar[int]
    T_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    T_QUEUED_FIELD_NUMBER: _ClassVar[int]
    T_DONE_FIELD_NUMBER: _ClassVar[int]
    T_REPLIED_FIELD_NUMBER: _ClassVar[int]
    target_s: float
    draft_hop_s: float
    draft_inputs_bytes: int
    draft_outputs_bytes: int
    decode_s: float
    worker_s: float
    t_received: float
    t_queued: float
    t_done: float
    t_replied: float
    def __init__(self, target_s: _Optional[float] = ..., draft_hop_s: _Optional[float] = ..., draft_inputs_bytes: _Optional[int] = ..., draft_outputs_bytes: _Optional[int] = ..., decode_s: _Optional[float] = ..., worker_s: _Optional[float] = ..., t_received: _Optional[float] = ..., t_queued: _Optional[float] = ..., t_done: _Optional[float] = ..., t_replied: _Optional[float] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TargetOutput(_message.Message):
    __slots__ = ("step_id", "results", "draft_outputs", "timing", "error", "columns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[SeqResult]
    draft_outputs: DraftOutputs
    timing: StepTiming
    error: StepError
    columns: ResultColumns
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SeqResult, _Mapping]]] = ..., draft_outputs: _Optional[_Union[DraftOutputs, _Mapping]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., columns: _Optional[_Union[ResultColumns, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("kind", "plan", "unanswered")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EXECUTE: _ClassVar[StepRequest.Kind]
        LAUNCH: _ClassVar[StepRequest.Kind]
        LAUNCH_AFTER: _ClassVar[StepRequest.Kind]
        COLLECT: _ClassVar[StepRequest.Kind]
    EXECUTE: StepRequest.Kind
    LAUNCH: StepRequest.Kind
    LAUNCH_AFTER: StepRequest.Kind
    COLLECT: StepRequest.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    kind: StepRequest.Kind
    plan: StepPlan
    unanswered: int
    def __init__(self, kind: _Optional[_Union[StepRequest.Kind, str]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ..., unanswered: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("rank", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class ResultColumns(_message.Message):
    __slots__ = ("request_ids", "token_counts", "new_token_ids", "num_drafted", "num_accepted")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_counts: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ...) -> None: ...
