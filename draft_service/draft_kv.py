"""The draft service's KV budget and prefix cache (issue 26). Plain Python,
no gRPC; :class:`~draft_service.sessions.SessionStore` applies them under its
lock.

- **Budget** (:class:`KVBudget`): in tokens (``--kv-budget-tokens``) or in
  bytes (``--kv-budget-bytes``; a token of a model costs its K+V bytes over
  all layers). It counts every session's KV (the model drafter's cache
  length; on CUDA the preallocated buffer, which is reserved from creation)
  and every stored prefix. Model-free drafters (prompt lookup) hold none.
- **Prefix cache** (:class:`PrefixCache`): per draft model, token sequence ->
  the KV cache holding exactly those tokens. A released session (Release, or
  its Session stream ended) leaves its cache here, by reference: nobody
  writes it any more. A new session's first draft call takes the entry with
  the longest common prefix with its context (same model) and starts from a
  copy of its KV cut to that length, so only the rest is prefilled. Entries
  are least recently used first, bounded by ``max_entries`` and the budget,
  and give way before any idle session does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from draft_service.drafter import common_prefix_len as common_prefix
from draft_service.onnx_model import KVCache

#: shorter prefixes are not worth an entry (nor a copy on a hit)
MIN_PREFIX_TOKENS = 4


@dataclass(frozen=True)
class KVBudget:
    """``tokens`` > 0 or ``bytes`` > 0 (bytes wins when both are set)."""

    tokens: int = 65_536
    bytes: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 and self.bytes < 1:
            raise ValueError("the draft KV budget needs kv_budget_tokens >= 1 or kv_budget_bytes >= 1")

    @property
    def in_bytes(self) -> bool:
        return self.bytes > 0

    @property
    def limit(self) -> int:
        return self.bytes if self.in_bytes else self.tokens

    @property
    def unit(self) -> str:
        return "bytes" if self.in_bytes else "tokens"

    def cost(self, tokens: int, bytes_per_token: int) -> int:
        """What ``tokens`` of a model with ``bytes_per_token`` take of the budget."""
        return tokens * bytes_per_token if self.in_bytes else tokens

    def max_tokens(self, bytes_per_token: int) -> int:
        """The most tokens one cache of that model can ever hold within the budget."""
        return self.bytes // max(1, bytes_per_token) if self.in_bytes else self.tokens


@dataclass
class PrefixEntry:
    """A stored KV cache: ``tokens`` are the model ids it holds (``cache.length``)."""

    model: Any  # the OnnxCausalLM the KV belongs to: reused only by drafters on it
    tokens: list[int]
    cache: KVCache
    bytes_per_token: int
    drafter: str  # the drafter that stored it (metrics labels)
    cost: int = 0  # what it takes of the budget (set by the store)


class PrefixCache:
    """LRU entries (not thread-safe: the session store's lock guards it)."""

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError("prefix_cache_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU first
        self._next = 0
        self.queries_tokens: dict[str, int] = {}  # per drafter: context tokens looked up
        self.hits_tokens: dict[str, int] = {}  # per drafter: tokens taken from an entry
        self.evictions = 0
        self.stored = 0
        self.cost = 0  # the entries' budget units

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        return list(self._entries.values())

    def lookup(self, model: Any, tokens: Sequence[int], drafter: str) -> tuple[PrefixEntry, int] | None:
        """The entry of ``model`` sharing the longest common prefix with
        ``tokens`` (touched: most recently used) and that length; None
        without one of at least MIN_PREFIX_TOKENS. Counts the query."""
        self.queries_tokens[drafter] = self.queries_tokens.get(drafter, 0) + len(tokens)
        best: tuple[int, int] | None = None
        for key, e in self._entries.items():
            if e.model is not model:
                continue
            n = common_prefix(e.tokens, tokens)
            if n >= MIN_PREFIX_TOKENS and (best is None or n > best[1]):
                best = (key, n)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        return self._entries[best[0]], best[1]

    def count_hit(self, drafter: str, tokens: int) -> None:
        self.hits_tokens[drafter] = self.hits_tokens.get(drafter, 0) + tokens

    def covered(self, entry: PrefixEntry) -> bool:
        """Whether an entry of the same model already holds all of ``entry``'s
        tokens (then it is touched and ``entry`` is not worth storing)."""
        for key, e in self._entries.items():
            if e.model is entry.model and len(e.tokens) >= len(entry.tokens) and \
                    common_prefix(e.tokens, entry.tokens) == len(entry.tokens):
                self._entries.move_to_end(key)
                return True
        return False

    def put(self, entry: PrefixEntry) -> None:
        """Stores ``entry`` as the most recently used one; entries it extends
        (their tokens a prefix of its tokens) are dropped, and the least
        recently used beyond ``max_entries``."""
        for key in [k for k, e in self._entries.items() if e.model is entry.model
                    and common_prefix(e.tokens, entry.tokens) == len(e.tokens)]:
            self.cost -= self._entries.pop(key).cost
        self._entries[self._next] = entry
        self.cost += entry.cost
        self._next += 1
        self.stored += 1
        while len(self._entries) > self.max_entries:
            self.pop_lru()

    def pop_lru(self) -> PrefixEntry | None:
        if not self._entries:
            return None
        _, e = self._entries.popitem(last=False)
        self.evictions += 1
        self.cost -= e.cost
        return e


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the draft KV (the metrics' and the error messages' numbers)."""

    used_tokens: int
    used_bytes: int
    used: int  # in the budget's unit
    sessions_holding: int
    entries: int
    entry_tokens: int


class DraftKVCollector(Collector):
    """Prometheus view of a session store's KV, read at every scrape."""

    def __init__(self, usage: Callable[[], KVUsage], budget: KVBudget, prefixes: Callable[[], PrefixCache | None],
                 evictions: Callable[[], dict[str, int]]) -> None:
        self._usage = usage
        self._budget = budget
        self._prefixes = prefixes
        self._evictions = evictions

    def collect(self) -> Iterator[Any]:
        u = self._usage()
        p = self._prefixes()
        used = GaugeMetricFamily("specdec_draft_kv_used_tokens", "KV tokens held by draft sessions and stored prefixes.",
                                 labels=["holder"])
        used.add_metric(["sessions"], u.used_tokens - u.entry_tokens)
        used.add_metric(["prefix_cache"], u.entry_tokens)
        yield used
        yield GaugeMetricFamily("specdec_draft_kv_used_bytes", "KV bytes held by draft sessions and stored prefixes.",
                                value=u.used_bytes)
        yield GaugeMetricFamily("specdec_draft_kv_budget_tokens", "The draft KV budget in tokens (0: set in bytes).",
                                value=0 if self._budget.in_bytes else self._budget.tokens)
        yield GaugeMetricFamily("specdec_draft_kv_budget_bytes", "The draft KV budget in bytes (0: set in tokens).",
                                value=self._budget.bytes)
        yield GaugeMetricFamily("specdec_draft_prefix_cache_entries", "Stored KV prefixes.", value=u.entries)
        ev = CounterMetricFamily("specdec_draft_kv_evictions", "KV given way for the budget: idle sessions evicted "
                                 "and prefix entries dropped (budget or entry limit).", labels=["kind"])
        for kind, n in sorted(self._evictions().items()):
            ev.add_metric([kind], n)
        yield ev
        q = CounterMetricFamily("specdec_draft_prefix_cache_queries_tokens",
                                "Context tokens of new draft sessions looked up in the prefix cache.",
                                labels=["drafter"])
        h = CounterMetricFamily("specdec_draft_prefix_cache_hits_tokens",
                                "Context tokens taken from the prefix cache instead of prefilled.", labels=["drafter"])
        if p is not None:
            for name, n in sorted(p.queries_tokens.items()):
                q.add_metric([name], n)
            for name, n in sorted(p.hits_tokens.items()):
                h.add_metric([name], n)
        yield q
        yield h


def register_kv_metrics(registry: CollectorRegistry, collector: DraftKVCollector) -> None:
    registry.register(collector)
