"""One session's forward pass through the decoder stack without transformers'
per-layer machinery, for the ``kquant`` two-call layers (issue 24).

With every decoder layer on ``fastlayers.layer_forward`` (two C calls), the
linear layers, attention and small ops of a 1-token step of the 1.5B target
take ~29 ms, and what is left of the step is Python: transformers' model
forward (its decorators, the causal mask, the keyword arguments every layer
is called with), 28 ``nn.Module`` calls, ``layer_forward``'s checks and four
allocations per layer, and the cache's ``update``: ~2-3 ms a step, 5-7 % of
it (docs/benchmarks.md, "the decoder stack in one C call"). :func:`forward` runs
the same computation with the model's own embedding, rotary tables, final
norm and LM head around one C call over every layer (``kq_stack``: per
layer ``kq_layer_pre``, the new keys and values copied into the session
layer's buffer, ``kq_layer_post``), which each growing cache layer
(``kv_adapter.GrowingLayer``) has made room for first (``reserve``) and
counts the tokens of after (``extend``), with scratch allocated once per
pass and the causal mask computed in the kernel (a single session has no
padding, and a masked key adds exact zeros), so the logits are the layer
path's bit for bit (tests/test_fast_stack.py). Should the call fail, no
layer holds the pass's tokens.

It applies to one session's pass (``runner.forward``) when every layer has
a two-call plan and the model runs an attention the kernel replaces, the
cache's layers are all growing full-attention layers, no forward hook or
pre-hook is registered on the model, its stack or a layer (a hook must see
its call), and torch would not split the MLP's SiLU over threads; anything
else returns None and the caller runs the model as before. The batched
pass (``runner.forward_batch``) keeps transformers' loop: its padded
layers are built as the model reaches them.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch
from torch.nn.modules import module as _module

from target_service import fastlayers
from target_service import kv_adapter as kv

_P, _I = ctypes.c_void_p, ctypes.c_int64

#: off switch, for comparisons (scripts/step_breakdown.py) and tests
ENABLED = True


def _hooked(mod: torch.nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks)


def _plans(model: Any, cache: kv.DynamicCache, t: int) -> list[Any] | None:
    """Each layer's two-call plan, or None where this path does not apply."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or len(cache.layers) != len(layers) or getattr(model, "lm_head", None) is None:
        return None
    if _module._global_forward_hooks or _module._global_forward_pre_hooks or _hooked(model) or _hooked(inner):
        return None
    plans = []
    for layer, c in zip(layers, cache.layers):
        p = getattr(layer, "_specdec_plan", None)
        if p is None or type(c) is not kv.GrowingLayer or _hooked(layer) or not layer._specdec_attention \
                or layer.self_attn.sliding_window is not None:
            return None
        plans.append(p)
    p0 = plans[0]
    if any((p.H, p.Hkv, p.D, p.hidden) != (p0.H, p0.Hkv, p0.D, p0.hidden) for p in plans):
        return None  # one scratch serves every layer
    if layers[0].self_attn.config._attn_implementation not in fastlayers.C_ATTENTION_FOR:
        return None
    if t * plans[0].inter >= fastlayers._TORCH_GRAIN and torch.get_num_threads() > 1:
        return None  # layer_forward would run fast_forward (torch splits the SiLU mid-row)
    return plans


def forward(model: Any, cache: kv.DynamicCache, ids: Sequence[int], keep: int) -> torch.Tensor | None:
    """Appends ``ids`` to ``cache`` and returns the logits of the last
    ``keep`` positions, [keep, V] float32, as ``runner.forward`` does; or
    None, with nothing done, where this path does not apply."""
    t = len(ids)
    plans = _plans(model, cache, t)
    if plans is None or t == 0:
        return None
    inner = model.model
    past = cache.get_seq_length()
    x = inner.embed_tokens(torch.tensor([list(ids)], dtype=torch.long))
    cos, sin = inner.rotary_emb(x, torch.arange(past, past + t).unsqueeze(0))
    p0 = plans[0]
    d = p0.D
    if x.dtype != torch.float32 or x.shape != (1, t, p0.hidden) or cos.dtype != torch.float32 \
            or cos.shape != (1, t, d) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    x = x.contiguous().clone()  # the kernel writes it: a buffer of our own
    h = torch.empty_like(x)
    qs = torch.empty((1, p0.H, t, d), dtype=torch.float32)
    ks = torch.empty((1, p0.Hkv, t, d), dtype=torch.float32)
    vs = torch.empty((1, p0.Hkv, t, d), dtype=torch.float32)
    n = len(plans)
    kb, vb, cap = (_P * n)(), (_P * n)(), (_I * n)()
    for i, layer in enumerate(cache.layers):
        held, bk, bv = layer.reserve(ks, vs)
        if held != past:
            raise RuntimeError(f"fast_stack: cache layer {i} holds {held} tokens, layer 0 {past}")
        kb[i], vb[i], cap[i] = bk.data_ptr(), bv.data_ptr(), bk.shape[2]
    layer_ptrs = (_P * n)(*[p.ptr for p in plans])
    rc = inner.layers[0]._specdec_lib.kq_stack(layer_ptrs, n, x.data_ptr(), h.data_ptr(), t, cos.data_ptr(),
                                                sin.data_ptr(), qs.data_ptr(), ks.data_ptr(), vs.data_ptr(),
                                                kb, vb, cap, past)
    if rc:  # 2 (an attention shape the kernel does not take) is ruled out by fastlayers.plan
        raise MemoryError("kquant layer: scratch allocation failed") if rc == 1 else \
            RuntimeError(f"kq_stack returned {rc}")
    for layer in cache.layers:  # the cache holds the pass's tokens only once every layer has them
        layer.extend(past, t)
    if n % 2:
        x = h
    x = inner.norm(x)
    return model.lm_head(x[:, -keep:, :])[0].float()
