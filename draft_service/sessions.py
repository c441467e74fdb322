"""Draft sessions: id -> (drafter, its cache state, committed tokens, sampling
config, RNG). The store is a cache: the orchestrator holds the authoritative
tokens and rebuilds a session that answered NOT_FOUND.

Thread safety: the store's dict is guarded by a lock (the event loop creates
and releases, the model worker proposes). One session's ``propose`` must not
run concurrently with itself; the single model worker guarantees that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from draft_service.drafter import Drafter, Proposal
from specdec.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, SpecdecError
from specdec.grammar import GrammarSpec, GrammarState, LazyGrammarCompiler
from specdec.logging_util import log
from specdec.sampling import SamplingConfig, session_rng
from specdec.session_ids import Tombstones, new_session_id
from specdec.validation import check_token_ids

logger = logging.getLogger("specdec.draft.sessions")


@dataclass
class DraftSession:
    id: str
    drafter: Drafter
    state: Any
    cfg: SamplingConfig
    rng: np.random.Generator
    committed: list[int] = field(default_factory=list)
    created: float = 0.0
    last_used: float = 0.0
    proposals: int = 0
    streamed: bool = False  # a Session stream's: ends with the stream, never reaped for idleness
    grammar: GrammarState | None = None  # structured output: q is masked by it

    def constraint(self, context: Sequence[int]) -> GrammarState | None:
        """The grammar state after ``context`` (the committed tokens, plus a
        stream's chain), or None without one. A context the grammar does not
        allow drops it: the session drafts unmasked from then on (still
        exact: the target masks p)."""
        if self.grammar is None:
            return None
        try:
            self.grammar.follow(context, 0)
        except SpecdecError as e:
            log(logger, logging.WARNING, "grammar dropped; drafting unmasked", session_id=self.id, error=e.message)
            self.grammar = None
        return self.grammar


@dataclass(frozen=True)
class ProposeResult:
    proposal: Proposal
    committed_len: int


class SessionStore:
    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        max_span: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_span = max_span
        self._clock = clock
        self._sessions: dict[str, DraftSession] = {}
        self._lock = threading.Lock()
        # ids released before a session held them (a caller whose create failed on its side)
        self._tombstones = Tombstones(clock=clock)
        self.created_total = 0
        self.released_total = 0
        self.reaped_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, drafter: Drafter, cfg: SamplingConfig, rng_offset: int = 0, streamed: bool = False,
               grammar: GrammarState | None = None, session_id: str = "") -> DraftSession:
        """A new session (``streamed``: owned by a Session stream). Seeded: stream ``rng_offset`` of the seed (0 = the
        seed's own stream; others are independent streams of the same seed,
        so a recreated session is reproducible but never replays the draws
        of the one it replaces, docs/design.md rule 6). ``session_id``: the
        id the caller chose ("" = a new one): ALREADY_EXISTS while a session
        holds it, NOT_FOUND when it was released before this create (the
        caller gave up on it: nothing is kept)."""
        now = self._clock()
        with self._lock:
            if session_id in self._tombstones:
                raise NotFound(f"draft session {session_id!r} was released before it was created")
            if session_id in self._sessions:
                raise AlreadyExists(f"draft session {session_id!r} already exists")
            if len(self._sessions) >= self.max_sessions:
                self._reap_locked(now)
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"draft service is at its session limit ({self.max_sessions})")
            rng = session_rng(cfg.seed, rng_offset)
            sid = session_id or new_session_id()
            session = DraftSession(
                id=sid, drafter=drafter, state=drafter.new_state(), cfg=cfg, rng=rng, created=now, last_used=now,
                streamed=streamed, grammar=grammar,
            )
            self._sessions[sid] = session
            self.created_total += 1
        return session

    def get(self, session_id: str) -> DraftSession:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(f"unknown draft session {session_id!r}")
            session.last_used = self._clock()
            return session

    def release(self, session_id: str) -> None:
        """NOT_FOUND for an id no session holds, which is then remembered for
        a while: a create with it (still on its way) keeps nothing."""
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                self._tombstones.add(session_id)
                raise NotFound(f"unknown draft session {session_id!r}")
            self.released_total += 1

    def discard(self, session_id: str) -> bool:
        """Releases a session if it exists; True when it did."""
        try:
            self.release(session_id)
        except NotFound:
            return False
        return True

    def reap(self) -> int:
        """Drops sessions idle for longer than ``ttl_s``; returns how many."""
        with self._lock:
            return self._reap_locked(self._clock())

    def _reap_locked(self, now: float) -> int:
        expired = [sid for sid, s in self._sessions.items() if not s.streamed and now - s.last_used > self.ttl_s]
        for sid in expired:
            del self._sessions[sid]
        if expired:
            self.reaped_total += len(expired)
            log(logger, logging.INFO, "reaped idle draft sessions", count=len(expired), ttl_s=self.ttl_s)
        return len(expired)

    def validate_propose(self, new_token_ids: Sequence[int], num_tokens: int, vocab_size: int) -> None:
        """Request checks that need no session state (run on the event loop)."""
        if num_tokens < 1 or num_tokens > self.max_span:
            raise InvalidArgument(f"num_tokens must be in [1, {self.max_span}], got {num_tokens}")
        check_token_ids(new_token_ids, vocab_size, "new_token_ids")

    def propose(
        self,
        session_id: str,
        base_len: int,
        new_token_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float = 0.0,
    ) -> ProposeResult:
        """Runs one Propose (on the model worker, or inline for an ``inline``
        drafter). committed = session.committed[:base_len] + new_token_ids;
        the drafter rejects an empty one (:class:`~draft_service.drafter.DraftRequest`)."""
        session = self.get(session_id)
        drafter = session.drafter
        self.validate_propose(new_token_ids, num_tokens, drafter.vocab_size)
        if base_len > len(session.committed):
            raise FailedPrecondition(
                f"base_len {base_len} exceeds the {len(session.committed)} committed tokens the session knows"
            )
        committed = session.committed[:base_len] + [int(t) for t in new_token_ids]
        proposal = drafter.propose(session.state, committed, num_tokens, session.cfg, session.rng, min_confidence,
                                   session.constraint(committed))
        session.committed = committed
        session.proposals += 1
        session.last_used = self._clock()
        return ProposeResult(proposal, len(committed))


async def grammar_state(grammars: LazyGrammarCompiler | None, drafter: str, request: Any) -> GrammarState | None:
    """The grammar state of a new session (``request``: a CreateDraftSessionRequest
    or DraftOpen), compiled off the event loop; None without a grammar, and
    when the drafter cannot apply it (it then drafts unmasked q, which the
    target's verification keeps exact; the target refuses a bad grammar)."""
    spec = GrammarSpec.from_proto(request.grammar) if request.HasField("grammar") else None
    if spec is None:
        return None
    if grammars is None:
        log(logger, logging.WARNING, "no tokenizer for structured output; drafting unmasked", drafter=drafter)
        return None
    try:
        return await asyncio.to_thread(grammars.state, spec, int(request.grammar_start))
    except (SpecdecError, ValueError) as e:
        log(logger, logging.WARNING, "grammar not applied; drafting unmasked", drafter=drafter, error=str(e)[:200])
        return None
