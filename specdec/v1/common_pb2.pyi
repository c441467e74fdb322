from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "batch_size", "batch_tokens")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    batch_size: int
    batch_tokens: int
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("drafter",)
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    def __init__(self, drafter: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "max_context_tokens", "dtype", "device", "tokenizer_fingerprint", "drafter", "backend", "numerics_chosen_by", "cpu_isa", "forward_cost", "calibrated", "drafters", "fidelity")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_CHOSEN_BY_FIELD_NUMBER: _ClassVar[int]
    CPU_ISA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_tokens: int
    dtype: str
    device: str
    tokenizer_fingerprint: str
    drafter: str
    backend: str
    numerics_chosen_by: str
    cpu_isa: str
    forward_cost: _containers.RepeatedCompositeFieldContainer[CostPoint]
    calibrated: _containers.RepeatedCompositeFieldContainer[CalibratedPair]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    fidelity: Fidelity
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., drafter: _Optional[str] = ..., backend: _Optional[str] = ..., numerics_chosen_by: _Optional[str] = ..., cpu_isa: _Optional[str] = ..., forward_cost: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., calibrated: _Optional[_Iterable[_Union[CalibratedPair, _Mapping]]] = ..., drafters: _Optional[_Iterable[str]] = ..., fidelity: _Optional[_Union[Fidelity, _Mapping]] = ...) -> None: ...

class Fidelity(_message.Message):
    __slots__ = ("positions", "mean_kl", "p99_kl", "max_kl", "top1_agreement", "corpus")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MEAN_KL_FIELD_NUMBER: _ClassVar[int]
    P99_KL_FIELD_NUMBER: _ClassVar[int]
    MAX_KL_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    positions: int
    mean_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float
    corpus: str
    def __init__(self, positions: _Optional[int] = ..., mean_kl: _Optional[float] = ..., p99_kl: _Optional[float] = ..., max_kl: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., corpus: _Optional[str] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("tokens", "ms")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    ms: float
    def __init__(self, tokens: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class CalibratedPair(_message.Message):
    __slots__ = ("dtype", "backend", "forward_cost", "score_tokens_per_s", "fidelity", "admissible")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    SCORE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FIELD_NUMBER: _ClassVar[int]
    ADMISSIBLE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    backend: str
    forward_cost: _containers.RepeatedCompositeFieldContainer[CostPoint]
    score_tokens_per_s: float
    fidelity: Fidelity
    admissible: bool
    def __init__(self, dtype: _Optional[str] = ..., backend: _Optional[str] = ..., forward_cost: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., score_tokens_per_s: _Optional[float] = ..., fidelity: _Optional[_Union[Fidelity, _Mapping]] = ..., admissible: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[bytes] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
