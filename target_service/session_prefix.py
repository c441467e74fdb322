"""Between the engine's sessions and its prefix cache: a released (or
prefilled) session's tokens and KV become an entry; a new session starts
from the longest stored prefix of its prompt; and the bytes all of them keep
alive are counted once each (what the KV manager's count should match).

Runs on the model worker thread (target_service/engine.py), like every
change to a session's cache.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from target_service import kv_adapter as kv
from target_service.kv_manager import KVManager
from target_service.prefix_cache import PrefixCache


class CachedSession(Protocol):
    cache: kv.DynamicCache
    cache_len: int
    tokens: list[int]
    cached_tokens: int


def store(prefix: PrefixCache | None, kvm: KVManager, sess: CachedSession) -> None:
    """Keeps the session's tokens and KV in the prefix cache, when they agree
    (a session whose last step failed is not kept), add something new, and
    fit beside the sessions (entries never push sessions out). Each layer
    gets tensors of its own: a rolled-back layer is a view that keeps the
    rejected tokens' storage."""
    if prefix is None or not sess.tokens:
        return
    if not (len(sess.tokens) == sess.cache_len == kv.length(sess.cache)):
        return
    if prefix.covers(sess.tokens) or not kvm.room_for_prefix(len(sess.tokens)):
        return
    layers = [(kv.owned(k), kv.owned(v)) for k, v in
              (kv.layer_kv(sess.cache, li) for li in range(kv.num_layers(sess.cache)))]
    prefix.store(sess.tokens, layers)


def start_from(prefix: PrefixCache | None, sess: CachedSession, token_ids: Sequence[int]) -> int:
    """Starts ``sess``'s cache from the longest stored prefix of
    ``token_ids`` (views of the entry's tensors, cut to the shared length);
    returns how many tokens it holds (0 = no hit)."""
    if prefix is None:
        return 0
    hit = prefix.lookup(token_ids)
    if hit is None:
        return 0
    for li, (keys, values) in enumerate(hit.entry.layers):
        kv.set_layer_kv(sess.cache, li, keys[:, :, : hit.length], values[:, :, : hit.length])
    sess.cache_len = sess.cached_tokens = hit.length
    return hit.length


def referenced_bytes(sessions: Iterable[CachedSession], prefix: PrefixCache | None) -> int:
    """Bytes of the KV storages the sessions and the prefix cache's entries
    keep alive, each storage once (a view keeps its whole base)."""
    seen: set[int] = set()
    total = sum(kv.storage_bytes(kv.cache_tensors(s.cache), seen) for s in sessions)
    if prefix is not None:
        total += kv.storage_bytes((t for e in prefix.entries() for kvs in e.layers for t in kvs), seen)
    return total
