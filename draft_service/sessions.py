"""Draft sessions: id -> (drafter, its cache state, committed tokens, sampling
config, RNG). The store is a cache: the orchestrator holds the authoritative
tokens and rebuilds a session that answered NOT_FOUND.

Thread safety: the store's dict is guarded by a lock (the event loop creates
and releases, the model worker proposes). One session's ``propose`` must not
run concurrently with itself; the single model worker guarantees that.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from draft_service.drafter import Drafter, Proposal
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.logging_util import log
from specdec.sampling import SamplingConfig

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
        self.created_total = 0
        self.released_total = 0
        self.reaped_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def create(self, drafter: Drafter, cfg: SamplingConfig, rng_offset: int = 0, streamed: bool = False) -> DraftSession:
        """A new session (``streamed``: owned by a Session stream). Seeded: stream ``rng_offset`` of the seed (0 = the
        seed's own stream; others are independent streams of the same seed,
        so a recreated session is reproducible but never replays the draws
        of the one it replaces, docs/design.md rule 6)."""
        now = self._clock()
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                self._reap_locked(now)
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"draft service is at its session limit ({self.max_sessions})")
            if cfg.seed is None:
                rng = np.random.default_rng()
            elif rng_offset:
                rng = np.random.default_rng([int(cfg.seed), int(rng_offset)])
            else:
                rng = np.random.default_rng(cfg.seed)
            sid = uuid.uuid4().hex
            session = DraftSession(
                id=sid, drafter=drafter, state=drafter.new_state(), cfg=cfg, rng=rng, created=now, last_used=now,
                streamed=streamed,
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
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
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
        for t in new_token_ids:
            if t < 0 or t >= vocab_size:
                raise InvalidArgument(f"token id {t} outside [0, {vocab_size})")

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
        proposal = drafter.propose(session.state, committed, num_tokens, session.cfg, session.rng, min_confidence)
        session.committed = committed
        session.proposals += 1
        session.last_used = self._clock()
        return ProposeResult(proposal, len(committed))
