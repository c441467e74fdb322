"""What the decode loop needs from the services: the replies it reads
(``PrefillReply``, ``VerifyReply``, ``ProposeReply``), the client protocols
it calls (``TargetClient``, ``DraftClient``, ``DraftStream``) and the
``RoundSink`` it reports every verified round to. The gRPC clients
(orchestrator/clients.py) and the routed ones (orchestrator/routing.py)
implement them; tests implement them without gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Protocol, Sequence

from orchestrator.policy import RoundObservation
from specdec.draft_chain import ChainPause, ChainToken
from specdec.grammar import GrammarSpec
from specdec.sampling import SamplingConfig, SparseQ, TokenLogprob

PostToken = tuple[int, "SparseQ | None"]  # a drafted token at the bonus position and its q (None: one-hot)


@dataclass(frozen=True)
class SessionOptions:
    """What a session keeps for its request besides sampling: logprobs of
    every emitted token with ``top_logprobs`` top tokens (-1 = none; target
    only), and structured output: the grammar the tokens from index
    ``grammar_start`` (the prompt's length) on must match."""

    top_logprobs: int = -1
    grammar: GrammarSpec | None = None
    grammar_start: int = 0


@dataclass(frozen=True)
class PrefillReply:
    session_id: str
    next_token: int | None
    logit_gap: float
    cache_len: int
    compute_ms: float
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the next token's, with SessionOptions.top_logprobs
    dead_end: bool = False  # the grammar allows no first token (next_token is None)
    cached_tokens: int = 0  # prompt tokens the target took from its prefix cache


@dataclass(frozen=True)
class VerifyReply:
    num_accepted: int
    next_token: int
    cache_len: int
    logit_gaps: list[float]
    compute_ms: float
    queue_ms: float
    queue_depth: int = 0
    batch_size: int = 1  # rows in the target's forward pass that served this call
    batch_tokens: int = 0  # real input tokens in that forward pass
    is_post: bool = False  # next_token is the post-verified drafted token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per emitted token, with SessionOptions.top_logprobs
    dead_end: bool = False  # the grammar allows no token after the accepted ones (next_token is not one)
    drafted: list[int] = field(default_factory=list)  # a decode-ahead step's own lookup span (target_service/self_lookup.py)
    ahead_left: int = 0  # decode-ahead: more replies of the run may follow (VerifyResponse.ahead_left)


@dataclass(frozen=True)
class ProposeReply:
    token_ids: list[int]
    q: list[SparseQ]
    committed_len: int
    compute_ms: float
    confidence: list[float] = field(default_factory=list)
    post: tuple[int, SparseQ] | None = None  # stream: the token after the span, already drafted
    waited_ms: float = 0.0  # stream: wall time the round waited for the span
    exposed_ms: float = 0.0  # stream: draft compute of the span's tokens that arrived while it waited
    cached_tokens: int = 0  # tokens the draft session took from its prefix cache on this call

    def problem(self, gamma: int, context_len: int) -> str:
        """What is wrong with this unary proposal on its face ("" = nothing):
        a span longer than asked for, q not one per drafted token, or tokens
        drafted after another context than the one sent (``context_len``: the
        draft's sequence, the committed tokens less what its context window
        left out, orchestrator/draft_window.py; docs/design.md §5)."""
        if len(self.token_ids) > gamma:
            return f"the draft proposed {len(self.token_ids)} tokens for a span of {gamma}"
        if self.q and len(self.q) != len(self.token_ids):
            return f"the draft sent {len(self.q)} distributions for {len(self.token_ids)} tokens"
        if self.committed_len != context_len:
            return f"the draft drafted after {self.committed_len} committed tokens, not the {context_len} it was sent"
        return ""


class TargetClient(Protocol):
    async def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int, timeout: float | None,
        options: SessionOptions | None = None,
    ) -> PrefillReply: ...

    async def verify(
        self,
        session_id: str,
        cache_len: int,
        new_ids: Sequence[int],
        draft_ids: Sequence[int],
        q: Sequence[SparseQ],
        timeout: float | None,
        post: PostToken | None = None,
        ahead: int = 0,  # decode-ahead: a plain round asks for this many more plain steps (orchestrator/clients.py)
        stop_ids: Collection[int] = (),  # ... which end after one of these tokens
        ahead_lookup: int = 0,  # ... whose steps may verify the target's own lookup span of at most this many tokens
    ) -> VerifyReply: ...

    async def release(self, session_id: str, timeout: float | None) -> None: ...


class DraftStream(Protocol):
    """An open ``Draft/Session`` stream (orchestrator/clients.py)."""

    session_id: str

    async def commit(self, version: int, token_ids: Sequence[int], draft_until: int, min_confidence: float) -> None: ...

    def ready(self) -> list[ChainToken | ChainPause]: ...

    async def wait(self, timeout: float) -> None: ...

    async def close(self) -> None: ...


class DraftClient(Protocol):
    async def create(self, cfg: SamplingConfig, drafter: str, timeout: float | None, rng_offset: int = 0,
                     options: SessionOptions | None = None) -> str:
        """A draft session; ``rng_offset`` picks a fresh random stream of a
        seeded request for each session it recreates (docs/design.md rule 6)."""

    async def propose(
        self,
        session_id: str,
        base_len: int,
        new_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float,
        timeout: float | None,
    ) -> ProposeReply: ...

    async def release(self, session_id: str, timeout: float | None) -> None: ...

    async def open_stream(
        self, cfg: SamplingConfig, drafter: str, rng_offset: int, token_ids: Sequence[int], draft_until: int,
        min_confidence: float, timeout: float | None, options: SessionOptions | None = None,
    ) -> DraftStream: ...


class RoundSink(Protocol):
    """Receives every verified round (the metrics path)."""

    def on_round(self, obs: RoundObservation, drafter: str) -> None: ...

    def on_fallback(self) -> None: ...

    def on_rebuild(self) -> None: ...


# ------------------------------------------------------- routing's interfaces
class Endpoint(Protocol):
    """One replica's connection: the service client, a health check, close."""

    client: Any

    async def check(self, timeout: float) -> bool: ...

    async def close(self) -> None: ...


class RoutingEvents(Protocol):
    """Receives routing events (the metrics path)."""

    def replica_added(self, service: str, replica: Any) -> None: ...

    def replica_removed(self, service: str, address: str) -> None: ...

    def replicas_changed(self, service: str, available: int, unavailable: int) -> None: ...

    def session_created(self, service: str, address: str) -> None: ...

    def replica_failed(self, service: str, address: str, error: str) -> None: ...


class NoEvents:
    def replica_added(self, service: str, replica: Any) -> None:
        pass

    def replica_removed(self, service: str, address: str) -> None:
        pass

    def replicas_changed(self, service: str, available: int, unavailable: int) -> None:
        pass

    def session_created(self, service: str, address: str) -> None:
        pass

    def replica_failed(self, service: str, address: str, error: str) -> None:
        pass
