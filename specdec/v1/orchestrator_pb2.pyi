from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_FIXED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_HEURISTIC: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR_DEAD_END: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_FIXED: SpeculationMode
SPECULATION_MODE_HEURISTIC: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_GRAMMAR_DEAD_END: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculationConfig(_message.Message):
    __slots__ = ("mode", "num_draft_tokens", "drafter", "min_confidence", "draft_mode")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    num_draft_tokens: int
    drafter: str
    min_confidence: float
    draft_mode: str
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., num_draft_tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., min_confidence: _Optional[float] = ..., draft_mode: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "messages", "max_new_tokens", "sampling", "stop", "speculation", "ignore_eos", "return_logit_gaps", "return_logprobs", "top_logprobs", "structured_output")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGIT_GAPS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationConfig
    ignore_eos: bool
    return_logit_gaps: bool
    return_logprobs: bool
    top_logprobs: int
    structured_output: _common_pb2.Grammar
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationConfig, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., return_logit_gaps: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "rounds", "mean_accepted_length", "time_to_first_token_ms", "tokens_per_second", "acceptance_rate", "prompt_tokens", "generated_tokens", "total_ms", "draft_ms", "verify_ms", "overhead_ms", "gamma_trajectory", "accepted_per_round", "draft_failures", "target_rebuilds", "drafter", "policy", "round_trip_ms", "prefill_ms", "draft_mode", "draft_hidden_ms", "post_verified", "round_overhead_p50_ms", "round_overhead_p99_ms", "cached_prompt_tokens", "draft_cached_prompt_tokens")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TARGET_REBUILDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_MS_FIELD_NUMBER: _ClassVar[int]
    POST_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ROUND_OVERHEAD_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_OVERHEAD_P99_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    rounds: int
    mean_accepted_length: float
    time_to_first_token_ms: float
    tokens_per_second: float
    acceptance_rate: float
    prompt_tokens: int
    generated_tokens: int
    total_ms: float
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    gamma_trajectory: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    draft_failures: int
    target_rebuilds: int
    drafter: str
    policy: str
    round_trip_ms: float
    prefill_ms: float
    draft_mode: str
    draft_hidden_ms: float
    post_verified: int
    round_overhead_p50_ms: float
    round_overhead_p99_ms: float
    cached_prompt_tokens: int
    draft_cached_prompt_tokens: int
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., total_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ..., gamma_trajectory: _Optional[_Iterable[int]] = ..., accepted_per_round: _Optional[_Iterable[int]] = ..., draft_failures: _Optional[int] = ..., target_rebuilds: _Optional[int] = ..., drafter: _Optional[str] = ..., policy: _Optional[str] = ..., round_trip_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., draft_mode: _Optional[str] = ..., draft_hidden_ms: _Optional[float] = ..., post_verified: _Optional[int] = ..., round_overhead_p50_ms: _Optional[float] = ..., round_overhead_p99_ms: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., draft_cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logit_gaps", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_GAPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logit_gaps: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logit_gaps: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
