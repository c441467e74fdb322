"""The one place that touches transformers' KV-cache internals.

The engine needs more of a ``DynamicCache`` than its public ``update``: it
runs several sessions' caches as one left-padded batch (:func:`batch_cache`,
whose layers pad and write back one layer at a time), and rolls a cache
back by a number of tokens after a verify. Those rely on
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

__all__ = ["DynamicCache", "RowsLayer", "batch_cache", "batchable", "bytes_per_token", "cache_tensors", "compact",
           "drop_last", "layer_kv", "length", "new_cache", "num_layers", "owned", "set_layer_kv", "storage_bytes"]


def new_cache(config: Any) -> DynamicCache:
    """An empty cache laid out for ``config`` (sliding-window or hybrid
    models get their own layer types)."""
    return DynamicCache(config=config)


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
    return all(type(layer) is DynamicLayer for layer in cache.layers)


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
    rejected tokens)."""
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
    once writes each row's past + new tokens back into its session's cache
    as a tensor of its own. So a batched forward holds one layer's padded
    copy at a time, not every layer's (which, for 16 sessions of 2,000
    tokens, was as large as all their KV, and set the process's peak
    memory), and the sessions' caches need no copying out afterwards.

    Its ``keys`` / ``values`` are zero-stride stand-ins of the batch's shape
    (what the model asks of a layer is its length)."""

    def __init__(self, li: int, rows: list[tuple[DynamicCache, int, int]], past: int) -> None:
        super().__init__()
        self.li, self.rows, self.past = li, rows, past  # rows: (cache, past, new tokens)
        self.advanced = False  # whether the rows' caches hold this layer's new tokens
        ref = next((c for c, n, _ in rows if n > 0), None)
        if ref is not None and past > 0:
            k, v = layer_kv(ref, li)
            self.device = k.device
            self.keys = k.new_zeros(()).expand(len(rows), k.shape[1], past, k.shape[3])
            self.values = v.new_zeros(()).expand(len(rows), v.shape[1], past, v.shape[3])
            self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, n, _ = key_states.shape
        p, li = self.past, self.li
        out = []
        for new in (key_states, value_states):
            full = new.new_zeros((b, new.shape[1], p + n, new.shape[3]))
            full[:, :, p:] = new
            out.append(full)
        keys, values = out
        for i, (cache, past, _) in enumerate(self.rows):
            if past:
                rk, rv = layer_kv(cache, li)
                keys[i, :, p - past : p] = rk[0]
                values[i, :, p - past : p] = rv[0]
        for i, (cache, past, n_i) in enumerate(self.rows):  # each row's real positions: [P - past, P + n_i)
            set_layer_kv(cache, li, keys[i : i + 1, :, p - past : p + n_i].clone(),
                         values[i : i + 1, :, p - past : p + n_i].clone())
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
    cache.layers = [RowsLayer(li, rows, past) for li in range(len(cache.layers))]
    return cache
