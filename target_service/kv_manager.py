"""The target's KV manager: which sessions hold KV, how much, and who gives
way when it runs out. Plain Python, no torch model, no gRPC.

It owns the session table (least recently used first), the KV budget (in
tokens and in bytes: ``bytes_per_token`` is the model's K+V bytes per token
over all layers), admission of new sessions (``max_sessions``), LRU eviction
of idle sessions, the reservations of prefills still running in chunks, and
the tombstones of ids released before their session existed.

The rules (docs/architecture.md, "KV manager"):

- The budget counts every committed token of every session, the whole
  prompt of each prefill in progress (reserved when it is admitted, so a
  chunked prefill cannot be starved of room half-way), and the tokens of
  the prefix cache's entries (target_service/prefix_cache.py).
- Room is made first by dropping prefix-cache entries, least recently used
  first (no request is using them), then by evicting least recently used
  sessions that are idle: not
  named in the current batch and not used within ``protect_active_s``.
  An *active* session is never evicted for another session's prompt or
  growth: that request gets RESOURCE_EXHAUSTED, with the numbers.
  ``protect_active_s = 0`` is plain LRU (any session outside the batch may
  be evicted; the orchestrator rebuilds it).

Thread-safety: every method takes the manager's lock; the engine calls it
from the model thread, the servicer calls :meth:`release` and
:meth:`reap_idle` from the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Collection, Generic, Protocol, TypeVar

from specdec.errors import AlreadyExists, NotFound, ResourceExhausted
from specdec.logging_util import log
from specdec.session_ids import Tombstones
from target_service.prefix_cache import PrefixCache

logger = logging.getLogger("specdec.target.kv")


class KVSession(Protocol):
    session_id: str
    cache_len: int
    last_used: float


S = TypeVar("S", bound=KVSession)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def kv_bytes_per_token(config: Any, dtype_name: str) -> int:
    """K and V bytes per token over all layers, from a transformers model
    config and the cache's element type (an estimate until
    :meth:`KVManager.measure` sees a real cache)."""
    text = getattr(config, "text_config", None) or config
    layers = int(getattr(text, "num_hidden_layers", 0) or 1)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(text, "head_dim", 0) or int(getattr(text, "hidden_size", heads)) // heads)
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype_name.removeprefix("torch."), 4)


class KVManager(Generic[S]):
    """Session table + KV budget (see module doc)."""

    def __init__(
        self,
        *,
        budget_tokens: int,
        bytes_per_token: int,
        max_sessions: int,
        protect_active_s: float,
        budget_bytes: int = 0,
    ) -> None:
        """``budget_bytes`` > 0 sets the budget in bytes (the token budget is
        then ``budget_bytes // bytes_per_token``, and follows
        :meth:`measure`); 0 keeps ``budget_tokens``."""
        self._budget_tokens = budget_tokens
        self._budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self.max_sessions = max_sessions
        self.protect_active_s = protect_active_s
        self._sessions: OrderedDict[str, S] = OrderedDict()  # LRU order
        self._reserved: dict[str, int] = {}  # prefills in progress: session id -> prompt tokens
        self.lock = threading.Lock()
        self._tombstones = Tombstones()
        self.evictions = 0
        self.prefix: PrefixCache | None = None  # the engine's prefix cache, when on: its entries count in the budget

    # ------------------------------------------------------------------ state
    @property
    def budget_tokens(self) -> int:
        if self._budget_bytes:
            return max(1, self._budget_bytes // self.bytes_per_token)
        return self._budget_tokens

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes or self._budget_tokens * self.bytes_per_token

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Tokens the sessions' caches hold (committed)."""
        return sum(s.cache_len for s in list(self._sessions.values()))

    @property
    def reserved_tokens(self) -> int:
        """Prompt tokens of the prefills in progress."""
        return sum(self._reserved.values())

    @property
    def prefix_tokens(self) -> int:
        """Tokens the prefix cache's entries hold."""
        return self.prefix.tokens if self.prefix is not None else 0

    @property
    def used_tokens(self) -> int:
        return self.cached_tokens + self.reserved_tokens + self.prefix_tokens

    @property
    def used_bytes(self) -> int:
        return self.used_tokens * self.bytes_per_token

    def others_active(self, session_id: str, within_s: float) -> bool:
        """Whether a session other than ``session_id`` was used within the last ``within_s`` seconds."""
        now = time.monotonic()
        with self.lock:
            for sid in reversed(self._sessions):  # most recently used last
                sess = self._sessions[sid]
                if now - sess.last_used >= within_s:
                    return False
                if sid != session_id:
                    return True
        return False

    def session_ids(self) -> list[str]:
        with self.lock:
            return list(self._sessions)

    def measure(self, bytes_per_token: int) -> None:
        """The real bytes per token, once a cache exists (the estimate from
        the config may miss a backend's cache dtype)."""
        if bytes_per_token > 0:
            self.bytes_per_token = bytes_per_token

    # --------------------------------------------------------------- sessions
    def peek(self, session_id: str) -> S | None:
        """The session, or None; does not count as a use."""
        with self.lock:
            return self._sessions.get(session_id)

    def get(self, session_id: str) -> S:
        with self.lock:
            sess = self._sessions.get(session_id)
            if sess is None:
                raise NotFound(f"unknown target session {session_id!r} (released, evicted or never created)")
            self._sessions.move_to_end(session_id)
        sess.last_used = time.monotonic()
        return sess

    def pop(self, session_id: str) -> S | None:
        """Frees the session and returns it (None when no session held the
        id, which is then remembered as :meth:`release` does)."""
        with self.lock:
            sess = self._sessions.pop(session_id, None)
            if sess is None:
                self._tombstones.add(session_id)
            return sess

    def release(self, session_id: str) -> bool:
        """Frees the session; True when it existed. An id no session holds
        is remembered for a while (its Prefill may still be queued or
        running: it then ends NOT_FOUND, leaving nothing)."""
        return self.pop(session_id) is not None

    def released_early(self, session_id: str) -> bool:
        """Whether a Release named ``session_id`` before its session existed."""
        with self.lock:
            return session_id in self._tombstones

    def _check_new_id(self, session_id: str) -> None:
        """Caller holds the lock: NOT_FOUND once released, ALREADY_EXISTS while a session holds it."""
        if session_id in self._tombstones:
            raise NotFound(f"target session {session_id!r} was released before its Prefill finished")
        if session_id in self._sessions or session_id in self._reserved:
            raise AlreadyExists(f"target session {session_id!r} already exists")

    def check_new_id(self, session_id: str) -> None:
        with self.lock:
            self._check_new_id(session_id)

    def insert(self, sess: S) -> None:
        """A finished prefill's session enters the table (its reservation
        ends); NOT_FOUND when it was released meanwhile (nothing is kept)."""
        with self.lock:
            self._reserved.pop(sess.session_id, None)
            self._check_new_id(sess.session_id)
            self._sessions[sess.session_id] = sess

    def reserve(self, session_id: str, tokens: int) -> None:
        """Holds ``tokens`` of the budget for a prefill that runs in chunks."""
        with self.lock:
            self._reserved[session_id] = tokens

    def unreserve(self, session_id: str) -> None:
        """A prefill in progress ended without a session (cancelled, failed)."""
        with self.lock:
            self._reserved.pop(session_id, None)

    def reap_idle(self, ttl_s: float) -> int:
        """Releases sessions idle for longer than ``ttl_s``; returns how many."""
        now = time.monotonic()
        with self.lock:
            stale = [sid for sid, s in self._sessions.items() if now - s.last_used > ttl_s]
            for sid in stale:
                del self._sessions[sid]
        if stale:
            log(logger, logging.INFO, "reaped idle sessions", count=len(stale))
        return len(stale)

    # ------------------------------------------------------------- admission
    def _victim(self, keep: Collection[str], idle_s: float) -> str | None:
        """The least recently used session not in ``keep`` and idle for at
        least ``idle_s`` seconds (caller holds the lock)."""
        now = time.monotonic()
        for sid, sess in self._sessions.items():  # LRU first
            if sid in keep:
                continue
            if now - sess.last_used < idle_s:
                return None  # the rest were used even more recently
            return sid
        return None

    def _evict(self, sid: str, why: str) -> None:
        del self._sessions[sid]
        self.evictions += 1
        log(logger, logging.INFO, f"evicted session for {why}", session_id=sid)

    def admit(self, requested_id: str, keep: Collection[str], new_sessions: int) -> None:
        """Room in the session table for one more session (after
        ``new_sessions`` already admitted in this batch): evicts idle LRU
        sessions, or RESOURCE_EXHAUSTED when all are active."""
        with self.lock:
            if requested_id:
                self._check_new_id(requested_id)
            while len(self._sessions) + len(self._reserved) + new_sessions >= self.max_sessions:
                victim = self._victim(keep, self.protect_active_s)
                if victim is None:
                    raise ResourceExhausted(
                        f"all {self.max_sessions} target sessions are in use (by the current batch or within "
                        f"the last {self.protect_active_s:g} s); retry later or on another replica"
                    )
                self._evict(victim, "max_sessions")

    def room_for_prefix(self, tokens: int) -> bool:
        """Whether a new prefix-cache entry of ``tokens`` fits the budget,
        after dropping older entries (least recently used first); never at
        any session's expense: False when the sessions hold too much."""
        with self.lock:
            while self.used_tokens + tokens > self.budget_tokens:
                if self.prefix is None or not self.prefix.evict_lru():
                    return False
            return True

    def make_room(self, new_tokens: int, keep: Collection[str], what: str) -> None:
        """Evicts idle least-recently-used sessions (never those in ``keep``
        nor any used within ``protect_active_s``) until ``new_tokens`` more
        fit the budget. When only active sessions are left:
        RESOURCE_EXHAUSTED naming ``what`` needs the room and the numbers
        (with ``protect_active_s = 0``, when every session left is in
        ``keep``, the batch is let through over the budget, as before)."""
        idle_s = self.protect_active_s
        with self.lock:
            while self.used_tokens + new_tokens > self.budget_tokens:
                if self.prefix is not None and self.prefix.evict_lru():
                    continue  # an unreferenced prefix goes before any session
                victim = self._victim(keep, idle_s)
                if victim is None:
                    if idle_s > 0:
                        used = self.used_tokens
                        raise ResourceExhausted(
                            f"{what} needs {new_tokens} KV tokens: {used} of this replica's budget of "
                            f"{self.budget_tokens} tokens ({used * self.bytes_per_token} of "
                            f"{self.budget_bytes} bytes) are held by {len(self._sessions)} sessions active in "
                            f"the last {idle_s:g} s (and {len(self._reserved)} prefills in progress), and an "
                            f"active session is never evicted; retry later or on another replica"
                        )
                    break
                self._evict(victim, "KV budget")
