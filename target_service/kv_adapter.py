"""The one place that touches transformers' KV-cache internals.

The engine needs more of a ``DynamicCache`` than its public ``update``: it
runs several sessions' caches as one left-padded batch (:func:`batch_cache`,
whose layers pad and write back one layer at a time), and rolls a cache
back by a number of tokens after a verify, and its sessions' layers
append in place (:class:`GrowingLayer`, a DynamicLayer whose tensors are
views of a buffer with room to grow). Those rely on
details that change between transformers releases: the per-layer objects
(``cache.layers``, ``DynamicLayer.keys/values``), lazy initialisation (a
layer holds no tensors until ``lazy_initialization`` or the first
``update``), and the sign of ``crop`` (since 5.18 only a negative count is
accepted, the tokens to remove; before 5.18 a positive one was the length
to keep). pyproject.toml pins the tested range; tests/test_kv_adapter.py
checks each of these against the installed release.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["DynamicCache", "GrowingLayer", "RowsLayer", "append_kv", "batch_cache", "batchable", "bytes_per_token",
           "cache_tensors", "compact", "drop_last", "headroom", "layer_kv", "length", "new_cache", "num_layers", "owned",
           "set_layer_kv", "storage_bytes"]

HEADROOM_MIN_TOKENS = 64  # a layer that must grow takes room for at least this many more tokens
HEADROOM_SHARE = 16  # ... or for 1/16 of its length, whichever is more


def headroom(tokens: int) -> int:
    """The tokens of room a growing layer allocates beyond ``tokens``."""
    return max(HEADROOM_MIN_TOKENS, tokens // HEADROOM_SHARE)


class GrowingLayer(DynamicLayer):
    """A session's full-attention layer whose appends write in place.

    transformers' DynamicLayer concatenates on every update: each step
    allocates the layer's whole K and V anew and copies them (28 layers × 2
    per step for the 1.5B target, all of every session's KV per batched
    step), and the freed tensors, each a little smaller than the next,
    fragment the heap (issue 26's soak: the target's RSS grew with activity
    well beyond the KV it held). This layer keeps its keys and values as
    views ``[:, :, :T]`` of buffers it allocated itself, with
    :func:`headroom` tokens of room; an append that fits is a copy of the
    new tokens alone, and only one that does not fit allocates (and copies
    the layer once).

    It writes in place only into a buffer it allocated, and only at
    positions at or past its own length: a rollback (``crop``) keeps a view
    of the same buffer, so the next append overwrites the rejected tokens.
    Keys set from outside (:func:`set_layer_kv`: a prefix-cache hit) are
    never written into: the next append moves them into a buffer of its
    own. Its tensors never fill their buffer (an append that would regrows),
    so :func:`owned` always copies them: no one else holds a view of a
    buffer that can still be written."""

    def __init__(self) -> None:
        super().__init__()
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        self._bufs = None
        super().reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(key_states, value_states)
        return self.keys, self.values

    def _writable(self, t: int, need: int, like: torch.Tensor) -> bool:
        b = self._bufs
        if b is None or b[0].shape[2] <= need or b[0].dtype != like.dtype or b[0].device != like.device:
            return False
        if b[0].shape[:2] != like.shape[:2] or b[0].shape[3] != like.shape[3]:
            return False
        if t == 0:
            return True
        k = self.keys
        return k.data_ptr() == b[0].data_ptr() and k.stride() == b[0].stride() and \
            self.values.data_ptr() == b[1].data_ptr() and self.values.stride() == b[1].stride()

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Makes room for ``key_states.shape[2]`` more tokens shaped like
        ``key_states`` / ``value_states`` ([B, H, n, D]), the layer's tokens
        kept (moved into a new buffer where they do not fit, or were set from
        outside); returns (the layer's tokens t, the key buffer, the value
        buffer), [B, H, capacity, D] with t + n < capacity. Nothing is written
        at rows t and after until :meth:`extend` says they hold tokens."""
        n = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = self.get_seq_length()
        need = t + n
        if not self._writable(t, need, key_states):
            cap = need + headroom(need)
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buf = new.new_empty((new.shape[0], new.shape[1], cap, new.shape[3]))
                if t:
                    buf[:, :, :t].copy_(old)
                grown.append(buf)
            self._bufs = (grown[0], grown[1])
            self.keys, self.values = grown[0][:, :, :t], grown[1][:, :, :t]
        bk, bv = self._bufs  # type: ignore[misc]
        return t, bk, bv

    def extend(self, t: int, n: int) -> None:
        """Rows t .. t + n − 1 of the buffers :meth:`reserve` returned (with
        t) now hold the next n tokens: the layer holds t + n."""
        bk, bv = self._bufs  # type: ignore[misc]
        self.keys, self.values = bk.narrow(2, 0, t + n), bv.narrow(2, 0, t + n)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Appends [B, H, n, D] keys and values after the layer's tokens."""
        t, bk, bv = self.reserve(key_states, value_states)
        n = key_states.shape[2]
        bk.narrow(2, t, n).copy_(key_states)
        bv.narrow(2, t, n).copy_(value_states)
        self.extend(t, n)


def new_cache(config: Any) -> DynamicCache:
    """An empty cache laid out for ``config``: full-attention layers are
    :class:`GrowingLayer` (appends in place); sliding-window or hybrid
    models keep their own layer types."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def append_kv(cache: DynamicCache, li: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Appends [B, H, n, D] keys and values to layer ``li`` (in place for a
    :class:`GrowingLayer`; a plain layer concatenates)."""
    layer = cache.layers[li]
    if isinstance(layer, GrowingLayer):
        layer.append(keys, values)
    elif not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        set_layer_kv(cache, li, keys.clone(), values.clone())
    else:
        set_layer_kv(cache, li, torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2))


def length(cache: DynamicCache) -> int:
    """Tokens the cache holds (0 before the first forward)."""
    return int(cache.get_seq_length())


def drop_last(cache: DynamicCache, n: int) -> None:
    """Removes the last ``n`` tokens from every layer (``n <= 0``: nothing)."""
    if n > 0:
        cache.crop(-n)


def num_layers(cache: DynamicCache) -> int:
    return len(cache.layers)


def batchable(cache: DynamicCache) -> bool:
    """Every layer is a plain (full-attention, growing) DynamicLayer, whose
    tensors can be padded into a batch and sliced back out; sliding-window
    or quantized layers keep their own layout."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def layer_kv(cache: DynamicCache, li: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``li``'s keys and values, [batch, heads, tokens, head_dim]."""
    layer = cache.layers[li]
    if not layer.is_initialized or layer.keys is None:
        raise ValueError(f"cache layer {li} holds no tokens yet")
    return layer.keys, layer.values


def set_layer_kv(cache: DynamicCache, li: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Makes layer ``li`` hold ``keys`` / ``values`` (views are kept as views),
    initialising it first when it has never been written."""
    layer = cache.layers[li]
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def bytes_per_token(cache: DynamicCache) -> int:
    """Bytes one token's keys and values take over all layers (0 before the
    first forward)."""
    total = 0
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None:
            k, v = layer.keys, layer.values
            total += k.element_size() * k.shape[1] * k.shape[3] + v.element_size() * v.shape[1] * v.shape[3]
    return total


def compact(cache: DynamicCache) -> None:
    """Copies every layer's tensors into their own contiguous storage (a
    view keeps its whole base alive)."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None:
            layer.keys = layer.keys.clone(memory_format=torch.contiguous_format)
            layer.values = layer.values.clone(memory_format=torch.contiguous_format)


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` when it is contiguous and all of its storage, else a copy that
    is (a view keeps its whole base alive: a rolled-back layer keeps the
    rejected tokens, a :class:`GrowingLayer`'s its headroom; and that layer
    may still write into its buffer, which its tensors never fill)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """Every key and value tensor the cache's layers hold."""
    return [t for layer in cache.layers if layer.is_initialized and layer.keys is not None
            for t in (layer.keys, layer.values)]


def storage_bytes(tensors: Any, seen: set[int] | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once
    (also across calls sharing ``seen``): what they keep alive, which for
    a view is its whole base tensor, not the elements it shows."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class RowsLayer(DynamicLayer):
    """One layer of a batched forward over several sessions' caches that
    holds no batch of its own: its ``update`` builds this layer's padded
    batch ([b, heads, P + N, head_dim], each row's past left-padded to P and
    its new tokens right-padded to N), gives it to the attention, and at
    once appends each row's new tokens to its session's cache (in place,
    :class:`GrowingLayer`). So a batched forward holds one layer's padded
    copy at a time, not every layer's (which, for 16 sessions of 2,000
    tokens, was as large as all their KV, and set the process's peak
    memory), and the sessions' caches need no copying out afterwards. The
    padded batch is one pair of buffers shared by all the layers of the
    forward (``scratch``): each layer's attention is done before the next
    layer's update refills it, and the padding, zeroed once, is never
    written.

    Its ``keys`` / ``values`` are zero-stride stand-ins of the batch's shape
    (what the model asks of a layer is its length)."""

    def __init__(self, li: int, rows: list[tuple[DynamicCache, int, int]], past: int,
                 scratch: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.li, self.rows, self.past = li, rows, past  # rows: (cache, past, new tokens)
        self.scratch = {} if scratch is None else scratch
        self.advanced = False  # whether the rows' caches hold this layer's new tokens
        ref = next((c for c, n, _ in rows if n > 0), None)
        if ref is not None and past > 0:
            k, v = layer_kv(ref, li)
            self.device = k.device
            self.keys = k.new_zeros(()).expand(len(rows), k.shape[1], past, k.shape[3])
            self.values = v.new_zeros(()).expand(len(rows), v.shape[1], past, v.shape[3])
            self.is_initialized = True

    def _padded(self, name: str, new: torch.Tensor) -> torch.Tensor:
        b, h, n, d = new.shape
        shape = (b, h, self.past + n, d)
        buf = self.scratch.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != new.dtype or buf.device != new.device:
            buf = self.scratch[name] = new.new_zeros(shape)
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        p, li = self.past, self.li
        keys, values = self._padded("keys", key_states), self._padded("values", value_states)
        keys[:, :, p:] = key_states
        values[:, :, p:] = value_states
        for i, (cache, past, _) in enumerate(self.rows):
            if past:
                rk, rv = layer_kv(cache, li)
                keys[i, :, p - past : p] = rk[0]
                values[i, :, p - past : p] = rv[0]
        for i, (cache, past, n_i) in enumerate(self.rows):  # each row's new tokens: [P, P + n_i)
            append_kv(cache, li, key_states[i : i + 1, :, :n_i], value_states[i : i + 1, :, :n_i])
        self.advanced = True
        self.device, self.is_initialized = key_states.device, True
        self.keys = keys.new_zeros(()).expand(keys.shape)
        self.values = values.new_zeros(()).expand(values.shape)
        return keys, values

    def undo(self) -> None:
        """Takes this layer's new tokens back out of the rows' caches (a
        forward that failed half-way: every session is left as it was)."""
        if not self.advanced:
            return
        for cache, past, _ in self.rows:
            k, v = layer_kv(cache, self.li)
            set_layer_kv(cache, self.li, k[:, :, :past], v[:, :, :past])
        self.advanced = False


def batch_cache(config: Any, rows: list[tuple[DynamicCache, int, int]]) -> DynamicCache:
    """A cache for one forward over ``rows`` ((session cache, its past
    tokens, the tokens this forward appends)), all plain DynamicLayers
    (:func:`batchable`): each layer a :class:`RowsLayer`."""
    cache = new_cache(config)
    past = max(n for _, n, _ in rows)
    scratch: dict[str, torch.Tensor] = {}
    cache.layers = [RowsLayer(li, rows, past, scratch) for li in range(len(cache.layers))]
    return cache
