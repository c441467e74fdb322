"""The target's model runner: one forward pass over one session's cache, or
over several sessions' caches padded into one batch. No sessions, no
sampling, no KV policy (target_service/engine.py and kv_manager.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from target_service import fast_stack
from target_service import kv_adapter as kv


@dataclass(frozen=True)
class BatchRow:
    cache: kv.DynamicCache  # the session's cache: ``past`` tokens before the forward, past + ids after
    ids: Sequence[int]  # the tokens this forward appends
    keep: int  # logits rows needed (the last ``keep`` positions of ``ids``)
    past: int  # tokens already in ``cache``


@torch.inference_mode()
def forward(model: Any, device: torch.device, cache_kwarg: str, cache: kv.DynamicCache, ids: Sequence[int],
            keep: int) -> torch.Tensor:
    """Appends ``ids`` to ``cache``; returns the logits of the last ``keep``
    positions, [keep, V] float32 (the LM head runs on those rows only).
    On the kquant two-call layers, one C call over them
    (target_service/fast_stack.py: the same bits)."""
    if fast_stack.ENABLED:
        logits = fast_stack.forward(model, cache, ids, keep)
        if logits is not None:
            return logits
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg: cache})
    return out.logits[0, -keep:].float()


@torch.inference_mode()
def forward_batch(model: Any, device: torch.device, cache_kwarg: str, rows: Sequence[BatchRow]) -> list[torch.Tensor]:
    """One forward pass over several sessions; returns each row's logits of
    its last ``keep`` positions ([keep, V] float32) and leaves each
    session's cache holding its past + ``ids`` (like :func:`forward`), in
    tensors of its own; when the forward fails, each as it was.

    Layout, with P = max past and N = max new tokens: each session's past
    KV is left-padded to P and its new tokens right-padded to N, so its real
    positions are the contiguous range [P - past, P + n) of the batched
    cache. A 2D attention mask zeroes the padding, position_ids carry each
    row's own positions (past + j), and the causal mask (in cache
    coordinates) does the rest. The padded batch is built one layer at a
    time, as the model reaches it (kv_adapter.RowsLayer). Padded query rows always see at least their
    row's real tokens, so no softmax row is fully masked.
    """
    dev = device
    b = len(rows)
    p = max(r.past for r in rows)
    n_max = max(len(r.ids) for r in rows)
    input_ids = torch.zeros((b, n_max), dtype=torch.long)
    positions = torch.empty((b, n_max), dtype=torch.long)
    mask = torch.zeros((b, p + n_max), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.ids)
        input_ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
        positions[i] = torch.arange(r.past, r.past + n_max)
        mask[i, p - r.past : p + n] = 1
    cache = kv.batch_cache(model.config, [(r.cache, r.past, len(r.ids)) for r in rows])
    first = min(len(r.ids) - r.keep for r in rows)  # earliest position whose logits are needed
    try:
        out = model(
            input_ids=input_ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            use_cache=True,
            logits_to_keep=n_max - first,
            **{cache_kwarg: cache},
        )
    except BaseException:
        for layer in cache.layers:  # the sessions' caches as they were (the engine retries the rows one by one)
            layer.undo()
        raise
    logits: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        n = len(r.ids)
        lo = n - r.keep - first
        logits.append(out.logits[i, lo : lo + r.keep].float())
    return logits

