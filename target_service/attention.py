"""Grouped-query attention for verify passes on CPU, without copying K/V.

transformers' SDPA path handles grouped-query attention (several query heads
per key/value head) in three ways: torch's ``enable_gqa`` when there is no
mask, packing the query heads for a single query token, and otherwise
``repeat_kv``, which copies every cached key and value once per query head
of its group. A verify pass has k > 1 query tokens and a mask (the cache is
longer than the pass), so it takes the copy: for the 1.5B target (12 query
heads over 2 KV heads) at 500 tokens of context that is ≈ 170 MB of copying
per pass, 37 ms of a 5-token verify on 2 cores, growing with the context.

``gqa_sdpa`` instead lays the k query rows of the heads that share a KV head
side by side, [B, H, k, D] → [B, H_kv, (H/H_kv)·k, D], repeats the k×S mask
for them (small), and calls SDPA on the K/V cache as it is. Each output row
is the same dot products, softmax and weighted sum over the same keys. The
logits were bit-identical to the copying path at the 1.5B target's shapes
(500 tokens of context, k = 5) and on a tiny GQA model from 17 tokens of
context on; at a 3-token context they differed by 1e-6, SDPA blocking a
4-row pass differently from a 2-row one (tests/test_target_engine.py).
Neither path is bit-identical with a 1-token step (that holds for the
linear layers only, docs/design.md), so nothing relies on it. Every other
case (no mask, one query token, position bias) goes to transformers' own
function unchanged. The kquant backends do not come here: their decoder
layers run ``kq_attention`` (target_service/fastlayers.py), whose rows are
bit-identical whatever the pass.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

NAME = "specdec_sdpa"
IDENTITY = "gqa-packed-1"  # part of the calibration cache's identity: bump when the timing can change


def gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, k, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, k, S] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_rep = int(getattr(module, "num_key_value_groups", 1))
    b, h, q, d = query.shape
    if (n_rep == 1 or q == 1 or attention_mask is None or attention_mask.shape[1] != 1
            or attention_mask.shape[2] != q or kwargs.get("position_bias") is not None or dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    packed = query.reshape(b, h // n_rep, n_rep * q, d)  # row r·k + i: query head (g·n_rep + r), token i
    mask = attention_mask.repeat(1, 1, n_rep, 1)  # [B, 1, n_rep·k, S], the same rows per head
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None  # [B, k, H, D]


@functools.lru_cache(maxsize=1)
def register() -> str:
    """Registers ``gqa_sdpa`` (with SDPA's masks) under NAME; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_packed_gqa(model: torch.nn.Module) -> bool:
    """Switches a model that runs transformers' SDPA with grouped-query
    attention to ``gqa_sdpa``; anything else is left as it is. Returns
    whether it switched."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv_heads = getattr(cfg, "num_attention_heads", 0), getattr(cfg, "num_key_value_heads", 0)
    if not heads or not kv_heads or heads == kv_heads:
        return False
    model.set_attn_implementation(register())
    return True
