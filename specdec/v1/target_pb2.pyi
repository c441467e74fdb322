from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("token_ids", "sampling", "sample_next_token", "rng_offset", "return_logprobs", "top_logprobs", "grammar", "grammar_start", "session_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RNG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    sample_next_token: bool
    rng_offset: int
    return_logprobs: bool
    top_logprobs: int
    grammar: _common_pb2.Grammar
    grammar_start: int
    session_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sample_next_token: _Optional[bool] = ..., rng_offset: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("session_id", "has_next_token", "next_token_id", "next_token_logit_gap", "cache_len", "timings", "next_token_logprobs", "grammar_applied", "grammar_dead_end", "cached_prompt_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGIT_GAP_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    has_next_token: bool
    next_token_id: int
    next_token_logit_gap: float
    cache_len: int
    timings: _common_pb2.Timings
    next_token_logprobs: _common_pb2.TokenLogprobs
    grammar_applied: bool
    grammar_dead_end: bool
    cached_prompt_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., has_next_token: _Optional[bool] = ..., next_token_id: _Optional[int] = ..., next_token_logit_gap: _Optional[float] = ..., cache_len: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., next_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., grammar_applied: _Optional[bool] = ..., grammar_dead_end: _Optional[bool] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "cache_len", "new_token_ids", "draft_token_ids", "draft_probs", "has_post_token", "post_token_id", "post_prob", "decode_ahead", "stop_token_ids", "ahead_lookup_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_POST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POST_PROB_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    has_post_token: bool
    post_token_id: int
    post_prob: _common_pb2.SparseDistribution
    decode_ahead: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ahead_lookup_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., has_post_token: _Optional[bool] = ..., post_token_id: _Optional[int] = ..., post_prob: _Optional[_Union[_common_pb2.SparseDistribution, _Mapping]] = ..., decode_ahead: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ahead_lookup_tokens: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "next_is_bonus", "cache_len", "logit_gaps", "timings", "batch_size", "queue_depth", "active_sessions", "next_is_post", "logprobs", "grammar_dead_end", "ahead_left", "self_drafted_token_ids")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_IS_BONUS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGIT_GAPS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_IS_POST_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    AHEAD_LEFT_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    next_is_bonus: bool
    cache_len: int
    logit_gaps: _containers.RepeatedScalarFieldContainer[float]
    timings: _common_pb2.Timings
    batch_size: int
    queue_depth: int
    active_sessions: int
    next_is_post: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    grammar_dead_end: bool
    ahead_left: int
    self_drafted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., next_is_bonus: _Optional[bool] = ..., cache_len: _Optional[int] = ..., logit_gaps: _Optional[_Iterable[float]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., batch_size: _Optional[int] = ..., queue_depth: _Optional[int] = ..., active_sessions: _Optional[int] = ..., next_is_post: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., grammar_dead_end: _Optional[bool] = ..., ahead_left: _Optional[int] = ..., self_drafted_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
