"""Draft sessions: id -> (drafter, its cache state, committed tokens, sampling
config, RNG). The store is a cache: the orchestrator holds the authoritative
tokens and rebuilds a session that answered NOT_FOUND.

It also keeps the draft KV within its budget and the prefix cache
(:mod:`draft_service.draft_kv`): a model drafter's state calls back
(:class:`SessionKV`) before its cache grows and when it is fresh; a session
that ends leaves its KV to the prefix cache. Room is made by dropping stored
prefixes (least recently used first), then idle sessions (least recently
used first; never one in a running call, a stream's, or one used within
``protect_active_s``), else RESOURCE_EXHAUSTED with the numbers.

Thread safety: the store's dict is guarded by a lock (the event loop creates
and releases, the model worker proposes). One session's ``propose`` must not
run concurrently with itself; the single model worker guarantees that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from draft_service.draft_kv import KVBudget, KVUsage, PrefixCache, PrefixEntry, MIN_PREFIX_TOKENS
from draft_service.drafter import Drafter, KVState, Proposal
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
    busy: int = 0  # draft calls running on its state (it is never evicted, nor its KV stored, meanwhile)
    closed: bool = False  # released, ended or evicted: its state is no longer this session's
    keep_prefix: bool = False  # closed by a release: its KV goes to the prefix cache once no call runs
    reserved: int = 0  # tokens its cache is about to hold (set before a call's cache grows)
    counted: int = 0  # budget units the store counts for it (recounted after each call)
    cached_tokens: int = 0  # context tokens its state took from the prefix cache (this session's life)

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


@dataclass(frozen=True)
class CatchUp:
    """One chunk of a long catch-up prefill ran instead of the draft call
    (:meth:`SessionStore.draft_step`): the caller runs the step again, as a
    new worker job, so other sessions' calls run between the chunks."""

    fed: int  # context tokens fed by this chunk
    remaining: int  # context tokens still to feed before drafting
    cached: int  # context tokens a fresh state took from the prefix cache


class SessionKV:
    """A model drafter session's :class:`~draft_service.drafter.KVHooks`."""

    def __init__(self, store: SessionStore, session: DraftSession) -> None:
        self.store = store
        self.session = session

    def seed(self, state: KVState, context: Sequence[int]) -> int:
        return self.store._seed(self.session, state, context)

    def reserve(self, state: KVState, tokens: int) -> None:
        self.store._reserve(self.session, state, tokens)


class SessionStore:
    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        max_span: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        budget: KVBudget | None = None,
        protect_active_s: float = 10.0,
        prefixes: PrefixCache | None = None,
    ) -> None:
        """``budget``: the draft KV budget (default 65536 tokens);
        ``prefixes``: the prefix cache (None = off)."""
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_span = max_span
        self.budget = budget or KVBudget()
        self.protect_active_s = protect_active_s
        self.prefixes = prefixes
        self.session_evictions = 0  # idle sessions evicted for the budget
        self._session_units = 0  # Σ counted over the sessions (the budget check never scans them)
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
            need = self._held(session)  # a CUDA buffer is reserved from the start
            if need:
                self._make_room_locked(session, need, "a new session")
            ks = drafter.kv_state(session.state)
            if ks is not None:
                ks.hooks = SessionKV(self, session)
            self._sessions[sid] = session
            session.counted = need
            self._session_units += need
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
        a while: a create with it (still on its way) keeps nothing. The
        session's KV goes to the prefix cache (once no call runs on it)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                self._tombstones.add(session_id)
                raise NotFound(f"unknown draft session {session_id!r}")
            self.released_total += 1
            self._drop_locked(session)
            session.keep_prefix = True
            if session.busy == 0:
                self._retire_locked(session)

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
        expired = [sid for sid, s in self._sessions.items()
                   if not s.streamed and not s.busy and now - s.last_used > self.ttl_s]
        for sid in expired:
            self._drop_locked(self._sessions.pop(sid))
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
        chunk_tokens: int = 0,
    ) -> ProposeResult | CatchUp:
        """Runs one Propose step (on the model worker, or inline for an
        ``inline`` drafter). committed = session.committed[:base_len] +
        new_token_ids; the drafter rejects an empty one
        (:class:`~draft_service.drafter.DraftRequest`). With ``chunk_tokens``
        > 0 and more than that to prefill first, one chunk of it runs and
        :class:`CatchUp` says so (:meth:`draft_step`); the caller repeats."""
        session = self.get(session_id)
        drafter = session.drafter
        self.validate_propose(new_token_ids, num_tokens, drafter.vocab_size)
        if base_len > len(session.committed):
            raise FailedPrecondition(
                f"base_len {base_len} exceeds the {len(session.committed)} committed tokens the session knows"
            )
        committed = session.committed[:base_len] + [int(t) for t in new_token_ids]
        out = self.draft_step(session, committed, num_tokens, min_confidence, chunk_tokens)
        session.last_used = self._clock()
        if isinstance(out, CatchUp):
            return out
        session.committed = committed
        session.proposals += 1
        return ProposeResult(out, len(committed))

    def draft_step(self, session: DraftSession, committed: Sequence[int], num_tokens: int,
                   min_confidence: float = 0.0, chunk_tokens: int = 0) -> Proposal | CatchUp:
        """A draft call on ``committed``, or, when more than ``chunk_tokens``
        (> 0) context tokens must be prefilled before it, one chunk of that
        prefill (:class:`CatchUp`). NOT_FOUND once the session has ended:
        a released session's catch-up stops at its next chunk."""
        drafter = session.drafter
        with self.using(session):
            if chunk_tokens > 0 and drafter.pending(session.state, committed) > chunk_tokens:
                fed, remaining, cached = drafter.catch_up(session.state, committed, chunk_tokens)
                return CatchUp(fed, remaining, cached)
            return drafter.propose(session.state, committed, num_tokens, session.cfg, session.rng,
                                   min_confidence, session.constraint(committed))

    # ------------------------------------------------------------ KV budget
    @contextlib.contextmanager
    def using(self, session: DraftSession) -> Iterator[None]:
        """Marks a draft call running on ``session``'s state: NOT_FOUND when
        the session has ended (a job queued before its release or eviction);
        meanwhile it is never evicted and its KV is not stored."""
        with self._lock:
            if session.closed:
                raise NotFound(f"draft session {session.id!r} was released or evicted")
            session.busy += 1
        try:
            yield
        finally:
            with self._lock:
                session.busy -= 1
                session.reserved = 0
                self._recount_locked(session)
                if session.closed and session.busy == 0 and session.keep_prefix:
                    self._retire_locked(session)

    def _recount_locked(self, session: DraftSession) -> None:
        if not session.closed:
            held = self._held(session)
            self._session_units += held - session.counted
            session.counted = held

    def _drop_locked(self, session: DraftSession) -> None:
        """``session`` has left the table: it no longer counts."""
        session.closed = True
        self._session_units -= session.counted
        session.counted = 0

    @property
    def used_units(self) -> int:
        """Budget units held (what the budget checks use; ``usage().used`` recounts them)."""
        with self._lock:
            return self._used_locked()

    def _used_locked(self) -> int:
        return self._session_units + (self.prefixes.cost if self.prefixes is not None else 0)

    def _held(self, session: DraftSession) -> int:
        """Budget units ``session`` takes now (its reservation included)."""
        model = session.drafter.kv_model
        ks = session.drafter.kv_state(session.state)
        if model is None or ks is None:
            return 0
        tokens = max(model.held_tokens(ks.cache), model.held_tokens(ks.cache, session.reserved))
        return self.budget.cost(tokens, model.kv_bytes_per_token)

    def evictions(self) -> dict[str, int]:
        """KV given way: idle sessions evicted for the budget, prefix entries dropped."""
        return {"session": self.session_evictions, "prefix": self.prefixes.evictions if self.prefixes is not None else 0}

    def usage(self) -> KVUsage:
        with self._lock:
            return self._usage_locked()

    def _usage_locked(self) -> KVUsage:
        tokens = nbytes = used = holding = 0
        for s in self._sessions.values():
            model = s.drafter.kv_model
            ks = s.drafter.kv_state(s.state)
            if model is None or ks is None:
                continue
            t = max(model.held_tokens(ks.cache), model.held_tokens(ks.cache, s.reserved))
            holding += t > 0
            tokens += t
            nbytes += t * model.kv_bytes_per_token
            used += self.budget.cost(t, model.kv_bytes_per_token)
        entries = self.prefixes.entries() if self.prefixes is not None else []
        entry_tokens = sum(e.cache.length for e in entries)
        for e in entries:
            nbytes += e.cache.length * e.bytes_per_token
            used += self.budget.cost(e.cache.length, e.bytes_per_token)
        return KVUsage(tokens + entry_tokens, nbytes, used, holding, len(entries), entry_tokens)

    def _victim_locked(self, keep: DraftSession) -> DraftSession | None:
        """The least recently used session that may give way: idle (no call
        running, not a stream's, not used within ``protect_active_s``) and
        holding KV."""
        now = self._clock()
        idle = [s for s in self._sessions.values() if s is not keep and not s.busy and not s.streamed
                and now - s.last_used >= self.protect_active_s and s.counted > 0]
        return min(idle, key=lambda s: s.last_used, default=None)

    def _make_room_locked(self, session: DraftSession, need: int, what: str) -> None:
        """Room for ``need`` more budget units for ``session``: stored prefixes
        go first, then idle sessions; else RESOURCE_EXHAUSTED."""
        while True:
            if self._used_locked() + need <= self.budget.limit:
                return
            if self.prefixes is not None and self.prefixes.pop_lru() is not None:
                continue
            victim = self._victim_locked(session)
            if victim is None:
                usage = self._usage_locked()
                unit = self.budget.unit
                raise ResourceExhausted(
                    f"{what} needs {need} more draft KV {unit}: {usage.used} of this draft replica's budget of "
                    f"{self.budget.limit} {unit} ({usage.used_tokens} tokens, {usage.used_bytes} bytes) are held "
                    f"by {usage.sessions_holding} sessions in use, streaming or active in the last "
                    f"{self.protect_active_s:g} s, and an active session is never evicted; retry later or on "
                    f"another replica"
                )
            del self._sessions[victim.id]
            self._drop_locked(victim)
            self.session_evictions += 1
            log(logger, logging.INFO, "evicted idle draft session for the KV budget", session_id=victim.id)

    def _reserve(self, session: DraftSession, state: KVState, tokens: int) -> None:
        model = session.drafter.kv_model
        if model is None:
            return
        with self._lock:
            if session.closed:  # released meanwhile: no more work for it
                raise NotFound(f"draft session {session.id!r} was released or evicted")
            before = session.counted
            after = self.budget.cost(model.held_tokens(state.cache, tokens), model.kv_bytes_per_token)
            if after > before:
                self._make_room_locked(session, after - before, f"draft session {session.id!r} growing to "
                                       f"{tokens} tokens")
            session.reserved = max(session.reserved, tokens)
            self._recount_locked(session)

    def _seed(self, session: DraftSession, state: KVState, context: Sequence[int]) -> int:
        model = session.drafter.kv_model
        if self.prefixes is None or model is None or not model.can_clone_prefix or len(context) <= MIN_PREFIX_TOKENS:
            return 0
        with self._lock:
            hit = self.prefixes.lookup(model, context, session.drafter.name)
        if hit is None:
            return 0
        entry, n = hit
        n = min(n, len(context) - 1)
        # room for the copy first (this entry is the most recently used one now: dropped last)
        self._reserve(session, state, n)
        state.cache = model.clone_prefix(entry.cache, n)
        state.tokens[:] = entry.tokens[:n]
        with self._lock:
            self.prefixes.count_hit(session.drafter.name, n)
        session.cached_tokens += n
        return n

    def _retire_locked(self, session: DraftSession) -> None:
        """A released session's KV becomes a prefix entry (by reference: its
        state is nobody's now), if it is worth one and fits the budget
        without evicting any session."""
        session.keep_prefix = False
        ks = session.drafter.kv_state(session.state)
        if ks is not None and not self._store_prefix_locked(session, ks):
            # nobody runs this state again: its buffers go now, not when the
            # garbage collector next breaks a reference cycle around the
            # session (a cancelled stream's frames); measured: without this,
            # 16 streams a round left ~20 MiB a round behind until gc ran
            ks.cache.free()

    def _store_prefix_locked(self, session: DraftSession, ks: KVState) -> bool:
        """Stores ``ks`` as a prefix entry if it is worth one and fits the
        budget without evicting any session; True when stored."""
        model = session.drafter.kv_model
        if self.prefixes is None or model is None or not model.can_clone_prefix:
            return False
        n = ks.cache.length
        if n < MIN_PREFIX_TOKENS or n != len(ks.tokens):
            return False
        bpt = model.kv_bytes_per_token
        entry = PrefixEntry(model, list(ks.tokens), ks.cache, bpt, session.drafter.name, self.budget.cost(n, bpt))
        ks.hooks = None
        if self.prefixes.covered(entry):
            return False
        while self._used_locked() + entry.cost > self.budget.limit:
            if self.prefixes.pop_lru() is None:
                return False  # the sessions hold the budget: not stored
        self.prefixes.put(entry)
        return True


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
