from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSessionRequest(_message.Message):
    __slots__ = ("open", "commit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    commit: DraftCommit
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., commit: _Optional[_Union[DraftCommit, _Mapping]] = ...) -> None: ...

class DraftOpen(_message.Message):
    __slots__ = ("sampling", "drafter", "rng_offset", "token_ids", "draft_until", "min_confidence", "batch_events", "grammar", "grammar_start")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    RNG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UNTIL_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    sampling: _common_pb2.SamplingParams
    drafter: str
    rng_offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_until: int
    min_confidence: float
    batch_events: bool
    grammar: _common_pb2.Grammar
    grammar_start: int
    def __init__(self, sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., rng_offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_until: _Optional[int] = ..., min_confidence: _Optional[float] = ..., batch_events: _Optional[bool] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class DraftCommit(_message.Message):
    __slots__ = ("token_ids", "version", "accepted", "draft_until", "min_confidence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UNTIL_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    version: int
    accepted: int
    draft_until: int
    min_confidence: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., accepted: _Optional[int] = ..., draft_until: _Optional[int] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class DraftSessionEvent(_message.Message):
    __slots__ = ("opened", "token", "paused", "batch")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    opened: DraftOpened
    token: DraftedToken
    paused: DraftPaused
    batch: DraftEventBatch
    def __init__(self, opened: _Optional[_Union[DraftOpened, _Mapping]] = ..., token: _Optional[_Union[DraftedToken, _Mapping]] = ..., paused: _Optional[_Union[DraftPaused, _Mapping]] = ..., batch: _Optional[_Union[DraftEventBatch, _Mapping]] = ...) -> None: ...

class DraftEventBatch(_message.Message):
    __slots__ = ("tokens", "paused")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[DraftedToken]
    paused: DraftPaused
    def __init__(self, tokens: _Optional[_Iterable[_Union[DraftedToken, _Mapping]]] = ..., paused: _Optional[_Union[DraftPaused, _Mapping]] = ...) -> None: ...

class DraftOpened(_message.Message):
    __slots__ = ("session_id", "drafter", "grammar_applied")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_APPLIED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drafter: str
    grammar_applied: bool
    def __init__(self, session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., grammar_applied: _Optional[bool] = ...) -> None: ...

class DraftedToken(_message.Message):
    __slots__ = ("position", "version", "token_id", "prob", "confidence", "compute_ms")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROB_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    position: int
    version: int
    token_id: int
    prob: _common_pb2.SparseDistribution
    confidence: float
    compute_ms: float
    def __init__(self, position: _Optional[int] = ..., version: _Optional[int] = ..., token_id: _Optional[int] = ..., prob: _Optional[_Union[_common_pb2.SparseDistribution, _Mapping]] = ..., confidence: _Optional[float] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class DraftPaused(_message.Message):
    __slots__ = ("position", "version", "reason", "commit")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    position: int
    version: int
    reason: str
    commit: int
    def __init__(self, position: _Optional[int] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., commit: _Optional[int] = ...) -> None: ...

class CreateDraftSessionRequest(_message.Message):
    __slots__ = ("sampling", "drafter", "rng_offset", "grammar", "grammar_start", "session_id")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    RNG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    sampling: _common_pb2.SamplingParams
    drafter: str
    rng_offset: int
    grammar: _common_pb2.Grammar
    grammar_start: int
    session_id: str
    def __init__(self, sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., rng_offset: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class CreateDraftSessionResponse(_message.Message):
    __slots__ = ("session_id", "drafter", "grammar_applied")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_APPLIED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drafter: str
    grammar_applied: bool
    def __init__(self, session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., grammar_applied: _Optional[bool] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "new_token_ids", "num_tokens", "min_confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    min_confidence: float
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "probs", "committed_len", "timings", "confidence", "drafter", "cached_prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    committed_len: int
    timings: _common_pb2.Timings
    confidence: _containers.RepeatedScalarFieldContainer[float]
    drafter: str
    cached_prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., committed_len: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., confidence: _Optional[_Iterable[float]] = ..., drafter: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...
