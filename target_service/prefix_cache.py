"""The target's prefix cache: token prefixes whose KV is kept after the
request that computed them, so that a later prompt starting with the same
tokens prefills only the rest. Plain Python and numpy; the KV itself is
opaque here (the engine hands in and takes out per-layer tensors through
target_service/kv_adapter.py).

Where entries come from (docs/architecture.md, "The KV manager"):

- a finished prefill: its prompt (a system prompt or a document that the
  next request shares while this one still runs);
- a released session: its prompt and the tokens it generated, as cached
  (the next turn of a chat starts with exactly those tokens).

An entry holds per-layer key and value tensors that no session writes
into. A session's layers append in place, into buffers of their own with
room to grow (kv_adapter.GrowingLayer), so what a session hands to an
entry is a compact copy (kv_adapter.owned, session_prefix.store); a new
session started from an entry holds views of it until its first append,
which moves them into a buffer of its own. A session that goes on
generating after its prompt was stored, or one started from an entry,
therefore never changes the entry.

Matching is by the longest common prefix over the entries (a new prompt
may diverge from a stored chat anywhere: after the system prompt, or after
turn 3). An entry whose tokens are a prefix of a newer one is dropped (the
newer one covers it). Entries are bounded in number, and in tokens by the
KV manager's budget, which evicts them least recently used first, before any
idle session (target_service/kv_manager.py).

Exactness: a hit starts a session from KV computed by an earlier forward,
over a different number of rows than a cold prefill would use. Under
numerics whose per-row result does not depend on the number of rows (the
int4 weight-only kernels, ``kquant``), the logits are the same; under
float32 they agree to rounding (~1e-6); under bfloat16 to ~1e-2, as for any
change of batch shape (docs/design.md rule on batching).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class PrefixEntry:
    tokens: np.ndarray  # int64, the tokens whose keys and values ``layers`` hold
    layers: list[tuple[Any, Any]]  # per layer (keys, values), [1, heads, len(tokens), head_dim]
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    length: int  # tokens of the entry the new prompt shares (a prefix of both)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PrefixCache:
    """Stored prefixes (see module doc). Thread-safe: the model thread looks
    up and stores, the KV manager evicts under its own lock (never both
    locks the other way round)."""

    def __init__(self, *, max_entries: int = 64, min_hit_tokens: int = 16) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.min_hit_tokens = max(1, min_hit_tokens)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU first
        self._next = 0
        self._lock = threading.Lock()
        self.queries_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits_tokens = 0  # of which taken from an entry (prefix_cache_hits)
        self.evicted_entries = 0
        self.stored_entries = 0

    @property
    def tokens(self) -> int:
        """Tokens the entries hold (their KV counts in the budget)."""
        with self._lock:
            return sum(len(e) for e in self._entries.values())

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        """The entries, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries.values())

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with ``prompt``, cut so that
        at least the prompt's last token is left to compute (its logits give
        the next token); None below ``min_hit_tokens``. Counts the query."""
        want = np.asarray(prompt, dtype=np.int64)
        best: tuple[int, int] | None = None
        with self._lock:
            self.queries_tokens += int(want.shape[0])
            for key, entry in self._entries.items():
                n = min(common_prefix(entry.tokens, want), int(want.shape[0]) - 1)
                if n >= self.min_hit_tokens and (best is None or n > best[1]):
                    best = (key, n)
            if best is None:
                return None
            entry = self._entries[best[0]]
            self._entries.move_to_end(best[0])
            entry.last_used = time.monotonic()
            entry.hits += 1
            self.hits_tokens += best[1]
            return PrefixHit(entry, best[1])

    def _covering(self, arr: np.ndarray) -> int | None:
        """The key of an entry that already holds ``arr`` (equal or longer); caller holds the lock."""
        for key, entry in self._entries.items():
            if len(entry) >= arr.shape[0] and common_prefix(entry.tokens, arr) == arr.shape[0]:
                return key
        return None

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether :meth:`store` would keep nothing new for ``tokens`` (an
        entry already holds them, or they are too short); touches that entry."""
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.shape[0] < self.min_hit_tokens:
            return True
        with self._lock:
            key = self._covering(arr)
            if key is None:
                return False
            self._entries.move_to_end(key)
            self._entries[key].last_used = time.monotonic()
            return True

    def store(self, tokens: Sequence[int], layers: list[tuple[Any, Any]]) -> bool:
        """Keeps ``layers`` (each [1, h, len(tokens), d]) as the KV of
        ``tokens``; False when an entry already covers them. Entries that
        ``tokens`` extend are dropped. Past ``max_entries`` the least
        recently used entry goes."""
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.shape[0] < self.min_hit_tokens:
            return False
        with self._lock:
            key = self._covering(arr)
            if key is not None:  # already covered (equal or longer)
                self._entries.move_to_end(key)
                self._entries[key].last_used = time.monotonic()
                return False
            for key, entry in list(self._entries.items()):
                if common_prefix(entry.tokens, arr) == len(entry):  # the new one extends it
                    del self._entries[key]
            self._entries[self._next] = PrefixEntry(arr, layers)
            self._next += 1
            self.stored_entries += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evicted_entries += 1
        return True

    def evict_lru(self) -> int:
        """Drops the least recently used entry; returns its tokens (0 when empty)."""
        with self._lock:
            if not self._entries:
                return 0
            _, entry = self._entries.popitem(last=False)
            self.evicted_entries += 1
            return len(entry)

    def clear(self) -> None:
        with self._lock:
            self.evicted_entries += len(self._entries)
            self._entries.clear()
