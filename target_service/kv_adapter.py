"""The one place that touches transformers' KV-cache internals.

The engine needs more of a ``DynamicCache`` than its public ``update``: it
left-pads several sessions' layers into one batched cache and hands each
session back views of it (``_forward_batch``), copies those views out, and
rolls a cache back by a number of tokens after a verify. Those rely on
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

__all__ = ["DynamicCache", "batchable", "bytes_per_token", "compact", "drop_last", "layer_kv", "length", "new_cache",
           "num_layers", "set_layer_kv"]


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
    """Copies every layer's tensors into their own contiguous storage (views
    into a batched cache would keep the whole padded batch alive)."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None:
            layer.keys = layer.keys.clone(memory_format=torch.contiguous_format)
            layer.values = layer.values.clone(memory_format=torch.contiguous_format)
