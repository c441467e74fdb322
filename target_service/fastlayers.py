"""A Qwen2 decoder layer's forward for the ``kquant`` backends, with the
small ops between the linear layers fused (issue 24).

transformers' decoder layer runs some 40 eager torch ops per layer and step
between our kernel calls (two RMSNorms of six ops each, rotary embedding
with ``rotate_half``'s slices, negation and ``torch.cat`` for the queries
and for the keys, the residual adds, the transposes and copies), each a
dispatch of a few microseconds on torch's single thread, and SDPA's CPU
flash-attention kernel costs ~80 µs per layer for one query: 12.7 ms of a
60 ms step of the 1.5B target (docs/benchmarks.md, "Where a quantized
step's time goes"). ``fast_forward`` does the same computation with one C
call per group of them (kquant.c, "a decoder layer's small ops"):

- input RMSNorm: ``kq_rmsnorm``;
- q, k, v: the fused projection's output taken directly, then
  ``kq_rope`` writes the rotated queries and keys as [B, H, T, D] from it
  (the same products and sums as ``q·cos + rotate_half(q)·sin``, so the
  same bits), ``kq_heads`` the values;
- attention: ``kq_attention`` (grouped-query, over the cache's own K/V
  views, its (batch row, KV head) units on the kernel's threads), for the
  model's SDPA or eager attention; any other implementation, or a mask
  that is not boolean, runs the model's own function;
- the residual add and the post-attention RMSNorm: one ``kq_rmsnorm``;
- SiLU(gate) · up: torch (``silu``, ``mul_``), as before, on the fused
  gate/up output;
- the last residual add in place.

Numerics. Rotary embedding, the residual adds and the MLP's activation are
transformers' float32 arithmetic, bit for bit. Two parts compute in their
own fixed order, so they differ from torch's in the last bits (float32
rounding; tested): RMSNorm's sum of squares (16 lanes, element i into lane
i mod 16, then the lanes pairwise) and attention (each score a 16-lane dot
product summed the same way, e^x by Cephes' polynomial, the weighted sum
of the values and the softmax denominator over the keys in order). Each row
is computed on its own: a masked key adds exact zeros, so a row's bits do
not depend on the rows, the batch rows, the left padding or the threads
beside it, and both kernel builds perform the same float32 operations
(plain C and vector extensions, no contraction), so they give the same bits.
With the kernel's linear layers (row-independent too), a row's logits are
the same for a prompt, a 1-token step, a k-token verify and a batched
verify (tests/test_fastlayers.py). Since the numerics change, they are a
property of the backend: IDENTITY (and the kquant.c source digest) are part
of the calibration cache's identity, so a calibration measured with
transformers' layers is not reused.

Two calls per layer. ``layer_forward`` (the default) runs the same
routines from two C calls around the cache's update, which stays in
Python: ``kq_layer_pre`` (input RMSNorm, the q/k/v kernel passes, rope,
heads) and ``kq_layer_post`` (attention, o_proj, residual add and
post-attention RMSNorm, the gate/up passes, SiLU·up, down_proj, the last
residual add), with the layer's constants in one ``kq_layer_t`` filled at
install time (``plan``). The same routines on the same inputs give the same
bits; ``kq_silu_mul`` is torch's vectorized float32 ``silu(gate).mul_(up)``
bit for bit (SLEEF's expf, then the division; checked over every float32
input), so it is used only where torch runs that loop over whole rows (the
MLP width a multiple of 32, and one torch thread or a pass below torch's
grain size, where a thread's range could start mid-row); anything else
runs ``fast_forward``. ``install(two_calls=False)`` keeps ``fast_forward``
(for comparisons).

Only ``Qwen2DecoderLayer`` with everything it expects (SiLU MLP, RMSNorm,
rotary embedding, float32 activations, kquant projections) is switched; a
call the fast path does not handle (another dtype, output attentions) runs
the original forward.
"""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Any

import torch

from target_service import kquant

IDENTITY = "fused-layers-3"  # (3: the decoder stack in one C call, fast_stack.py) part of the calibration cache's identity: bump when the numerics or timing can change

_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.lru_cache(maxsize=2)
def _lib(which: str) -> ctypes.CDLL:
    lib, why = kquant._library(which)
    if lib is None:
        raise RuntimeError(f"the kquant kernel is not available: {why}")
    lib.kq_rmsnorm.restype = None
    lib.kq_rmsnorm.argtypes = [_P, _P, _P, _P, ctypes.c_float, _I, _I, _P]
    lib.kq_rope.restype = None
    lib.kq_rope.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _P]
    lib.kq_heads.restype = None
    lib.kq_heads.argtypes = [_P, _I, _I, _I, _I, _I, _P]
    lib.kq_attention.restype = ctypes.c_int
    lib.kq_attention.argtypes = [_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _I, _I, _I, _I, _I,
                                 _P, _I, _I, _I, ctypes.c_int, ctypes.c_float, _P]
    lib.kq_silu_mul.restype = None
    lib.kq_silu_mul.argtypes = [_P, _I, _P, _I, _I, _I, _P]
    lib.kq_layer_pre.restype = ctypes.c_int
    lib.kq_layer_pre.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, _P, _P]
    lib.kq_layer_post.restype = ctypes.c_int
    lib.kq_layer_post.argtypes = [_P, _P, _I, _I, _P, _P, _I, _I, _I, _P, _I, _I, _I, _I, _P, _I, _I, _I, _P]
    lib.kq_stack.restype = ctypes.c_int  # fast_stack.py: a session's pass through every layer
    lib.kq_stack.argtypes = [_P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I]
    return lib


def attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor | None:
    """``kq_attention`` of q [B, H, T, D] (contiguous) over k, v [B, Hkv, S,
    D] (unit stride along D) under ``mask`` (None: causal; or bool [B or 1,
    1, T, S]): [B, T, H, D], or None when the inputs are of another form (the
    caller then runs the model's own attention)."""
    b, h, t, d = q.shape
    if k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    hkv, s = k.shape[1], k.shape[2]
    if k.shape != (b, hkv, s, d) or v.shape != k.shape or h % hkv:
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (t, s) \
                or mask.shape[0] not in (1, b):
            return None
        msb = mask.stride(0) if mask.shape[0] == b else 0
        mptr, mst, mss = mask.data_ptr(), mask.stride(2), mask.stride(3)
    else:
        mptr, msb, mst, mss = None, 0, 0, 0
    out = torch.empty((b, t, h, d), dtype=torch.float32)
    rc = lib.kq_attention(q.data_ptr(), b, h, t, d, k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                          v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), hkv, s,
                          mptr, msb, mst, mss, 1, scale, out.data_ptr())
    if rc == 2:
        return None
    if rc != 0:
        raise MemoryError("kquant attention: scratch allocation failed")
    return out


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) of float32 rows ``x`` [..., K], h = x + residual when
    given (a new tensor), else x."""
    k = x.shape[-1]
    x = x.contiguous()
    m = x.numel() // k
    y = torch.empty_like(x)
    if residual is None:
        lib.kq_rmsnorm(x.data_ptr(), None, None, weight.data_ptr(), eps, m, k, y.data_ptr())
        return x, y
    residual = residual.contiguous()
    h = torch.empty_like(x)
    lib.kq_rmsnorm(x.data_ptr(), residual.data_ptr(), h.data_ptr(), weight.data_ptr(), eps, m, k, y.data_ptr())
    return h, y


def _projections(mods: list[torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """Each module's output for ``x``: the members of one fused projection
    from one kernel call (column slices of its output), the rest by calling them."""
    outs: list[torch.Tensor | None] = [None] * len(mods)
    shared: dict[int, torch.Tensor] = {}
    for i, mod in enumerate(mods):
        if isinstance(mod, kquant.FusedSlice):
            fused = mod.fused  # type: ignore[attr-defined]
            out = shared.get(id(fused))
            if out is None:
                out = shared[id(fused)] = fused.linear(x)
            lo, hi = fused.bounds[mod.index]
            outs[i] = out[..., lo:hi]
        else:
            outs[i] = mod(x)
    return outs  # type: ignore[return-value]


def _rows(t: torch.Tensor, width: int) -> tuple[torch.Tensor, int] | None:
    """(t, its row stride) when ``t`` [B, T, width] is float32 rows of unit
    column stride at a fixed row stride (a column slice of a contiguous
    output), else None."""
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.shape[-1] != width:
        return None
    b, n = t.shape[0], t.shape[1]
    rs = t.stride(1)
    if n > 1 and rs < width:
        return None
    if b > 1 and t.stride(0) != n * rs:
        return None
    return t, rs


def fast_forward(self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **kwargs: Any) -> torch.Tensor:
    """Qwen2DecoderLayer.forward with the small ops fused (see the module's doc)."""
    if "past_key_values" in kwargs and cache is None:
        cache = kwargs.pop("past_key_values")
    x = hidden_states
    if (x.dtype != torch.float32 or x.dim() != 3 or position_embeddings is None
            or position_embeddings[0].dtype != torch.float32 or kwargs.get("output_attentions")):
        return self._specdec_eager_forward(hidden_states, attention_mask=attention_mask,  # type: ignore[operator]
                                           position_ids=position_ids, cache=cache, use_cache=use_cache,
                                           position_embeddings=position_embeddings, **kwargs)
    lib = self._specdec_lib  # type: ignore[attr-defined]
    attn = self.self_attn  # type: ignore[attr-defined]
    ln1 = self.input_layernorm  # type: ignore[attr-defined]
    b, t, _ = x.shape
    d = attn.head_dim
    _, y = rmsnorm(lib, x, ln1.weight, ln1.variance_epsilon)
    q, k, v = _projections([attn.q_proj, attn.k_proj, attn.v_proj], y)
    cos, sin = (c.expand(b, t, d).contiguous() for c in position_embeddings)
    heads = []
    for src, rotate in ((q, True), (k, True), (v, False)):
        h = src.shape[-1] // d
        rows = _rows(src, h * d)
        if rows is None:
            src = src.contiguous()
            rows = (src, h * d)
        out = torch.empty((b, h, t, d), dtype=torch.float32)
        if rotate:
            lib.kq_rope(rows[0].data_ptr(), rows[1], b, t, h, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
        else:
            lib.kq_heads(rows[0].data_ptr(), rows[1], b, t, h, d, out.data_ptr())
        heads.append(out)
    qs, ks, vs = heads
    if cache is not None:
        ks, vs = cache.update(ks, vs, attn.layer_idx, kwargs=kwargs)
    return _rest(self, lib, x, qs, ks, vs, attention_mask, kwargs)


def _rest(self: torch.nn.Module, lib: ctypes.CDLL, x: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor,
          vs: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """fast_forward from the queries and the cache's keys and values on."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = self.self_attn  # type: ignore[attr-defined]
    mlp = self.mlp  # type: ignore[attr-defined]
    ln2 = self.post_attention_layernorm  # type: ignore[attr-defined]
    b, t, _ = x.shape
    out = None
    if (self._specdec_attention and attn.config._attn_implementation in C_ATTENTION_FOR  # type: ignore[attr-defined]
            and attn.sliding_window is None and kwargs.get("position_bias") is None):
        out = attention(lib, qs, ks, vs, attention_mask, attn.scaling)
    if out is None:
        from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = interface(attn, qs, ks, vs, attention_mask, dropout=0.0, scaling=attn.scaling,
                           sliding_window=attn.sliding_window, **kwargs)
    o = attn.o_proj(out.reshape(b, t, -1))
    h, y = rmsnorm(lib, x, ln2.weight, ln2.variance_epsilon, residual=o)
    gate, up = _projections([mlp.gate_proj, mlp.up_proj], y)
    act = torch.nn.functional.silu(gate).mul_(up)
    h += mlp.down_proj(act)
    return h


# ------------------------------------------------- the layer in two C calls
class _Lin(ctypes.Structure):
    """kquant.c's kq_lin_t: one kernel pass (a KQuantLinear's constants)."""
    _fields_ = [("kind", _I), ("a8", _I), ("K", _I), ("N", _I), ("w", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    """kquant.c's kq_layer_t: a decoder layer's constants for kq_layer_pre / kq_layer_post."""
    _fields_ = [("hidden", _I), ("H", _I), ("Hkv", _I), ("D", _I), ("inter", _I), ("ln1", _P), ("ln2", _P),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
                ("unused", ctypes.c_float), ("nqkv", _I), ("qkv", _Lin * 3), ("qkv_call", _I * 3),
                ("qkv_off", _I * 3), ("o", _Lin), ("ngu", _I), ("gu", _Lin * 2), ("gu_call", _I * 2),
                ("gu_off", _I * 2), ("down", _Lin)]


def _lin(mod: kquant.KQuantLinear) -> _Lin:
    return _Lin(kquant.KINDS[mod.kind], int(mod.acts == "a8"), mod.in_features, mod.out_features,
                mod.packed.data_ptr(), None if mod.bias is None else mod.bias.data_ptr())


def _passes(mods: list[torch.nn.Module]) -> tuple[list[kquant.KQuantLinear], list[int], list[int]]:
    """The kernel passes that compute ``mods`` (one per fused projection, as
    _projections), and each module's pass and first column in its output."""
    passes: list[kquant.KQuantLinear] = []
    calls, offs = [], []
    for mod in mods:
        if isinstance(mod, kquant.FusedSlice):
            lin, off = mod.fused.linear, mod.fused.bounds[mod.index][0]  # type: ignore[attr-defined]
        else:
            lin, off = mod, 0
        if not any(p is lin for p in passes):
            passes.append(lin)  # type: ignore[arg-type]
        calls.append(next(i for i, p in enumerate(passes) if p is lin))
        offs.append(off)
    return passes, calls, offs


#: torch runs silu over a row with its vectorized loop (kq_silu_mul's
#: arithmetic) when the row is a multiple of twice its vector width (32
#: floats covers AVX-512 and AVX2), and on one thread or below its grain
#: size (at::internal::GRAIN_SIZE: above it, with several threads, a
#: thread's range can start mid-row and torch computes its odd elements
#: with its scalar expf)
_SILU_ALIGN = 32
_TORCH_GRAIN = 32768


class _Plan:
    """A layer's constants for the two-call path, pinned at install time."""

    __slots__ = ("struct", "ptr", "hidden", "H", "Hkv", "D", "inter", "tensors")

    def __init__(self, layer_struct: _Layer, tensors: list[torch.Tensor]) -> None:
        self.struct = layer_struct
        self.ptr = ctypes.addressof(layer_struct)
        self.hidden, self.H, self.Hkv = layer_struct.hidden, layer_struct.H, layer_struct.Hkv
        self.D, self.inter = layer_struct.D, layer_struct.inter
        self.tensors = tensors  # the weights the struct points into, held


def plan(layer: torch.nn.Module) -> _Plan | None:
    """The two-call path's constants for an eligible layer, or None where
    it does not apply (a head size kq_attention does not take, an MLP width
    torch's silu would not run vectorized over)."""
    attn, mlp = layer.self_attn, layer.mlp  # type: ignore[attr-defined]
    d = attn.head_dim
    if d % 16 or d > 256:
        return None
    qkv, qcall, qoff = _passes([attn.q_proj, attn.k_proj, attn.v_proj])
    gu, gcall, goff = _passes([mlp.gate_proj, mlp.up_proj])
    if len(qkv) > 3 or len(gu) > 2 or not isinstance(attn.o_proj, kquant.KQuantLinear) \
            or not isinstance(mlp.down_proj, kquant.KQuantLinear):
        return None
    hidden = attn.o_proj.out_features
    h, hkv = attn.q_proj.out_features // d, attn.k_proj.out_features // d
    inter = mlp.gate_proj.out_features
    if inter % _SILU_ALIGN or attn.v_proj.out_features != hkv * d or mlp.up_proj.out_features != inter \
            or h % hkv or attn.o_proj.in_features != h * d or mlp.down_proj.in_features != inter:
        return None
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm  # type: ignore[attr-defined]
    if any(not t.weight.is_contiguous() for t in (ln1, ln2)):
        return None
    st = _Layer()
    st.hidden, st.H, st.Hkv, st.D, st.inter = hidden, h, hkv, d, inter
    st.ln1, st.ln2 = ln1.weight.data_ptr(), ln2.weight.data_ptr()
    st.eps1, st.eps2, st.scale = ln1.variance_epsilon, ln2.variance_epsilon, attn.scaling
    st.nqkv, st.ngu = len(qkv), len(gu)
    for i, p in enumerate(qkv):
        st.qkv[i] = _lin(p)
    for i in range(3):
        st.qkv_call[i], st.qkv_off[i] = qcall[i], qoff[i]
    for i, p in enumerate(gu):
        st.gu[i] = _lin(p)
    for i in range(2):
        st.gu_call[i], st.gu_off[i] = gcall[i], goff[i]
    st.o, st.down = _lin(attn.o_proj), _lin(mlp.down_proj)
    tensors = [ln1.weight, ln2.weight] + [m.packed for m in qkv + gu + [attn.o_proj, mlp.down_proj]]
    tensors += [m.bias for m in qkv + gu + [attn.o_proj, mlp.down_proj] if m.bias is not None]
    return _Plan(st, tensors)


# the last mask's and rotary tables' kernel arguments: every layer of a
# forward pass gets the same tensors (held here, so that their identity is not reused)
_mask_memo: list[Any] = [None]
_rope_memo: list[Any] = [None]


def _mask_args(mask: torch.Tensor | None, b: int, t: int, s: int) -> tuple[int | None, int, int, int] | None:
    memo = _mask_memo[0]
    if memo is not None and memo[0] is mask and memo[1] == (b, t, s):
        return memo[2]
    if mask is None:
        args: tuple[int | None, int, int, int] | None = (None, 0, 0, 0)
    elif mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (t, s) \
            or mask.shape[0] not in (1, b):
        args = None
    else:
        args = (mask.data_ptr(), mask.stride(0) if mask.shape[0] == b else 0, mask.stride(2), mask.stride(3))
    _mask_memo[0] = (mask, (b, t, s), args)
    return args


def _pass_args(pe: tuple[torch.Tensor, torch.Tensor], b: int, t: int, d: int,
               config: Any) -> tuple[int, int, int, bool]:
    """The rotary tables' kernel arguments (cos, sin, batch stride) and
    whether the model runs an attention kq_attention replaces: once per
    forward pass (config attribute reads cost microseconds each)."""
    memo = _rope_memo[0]
    if memo is not None and memo[0] is pe and memo[1] == (b, t, d) and memo[4] is config:
        return memo[2]
    cos, sin = pe
    held: tuple[Any, ...] = ()
    if cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b) \
            and cos.stride() == sin.stride() and cos.stride(1) == d and cos.stride(2) == 1:
        csb = cos.stride(0) if cos.shape[0] == b and b > 1 else 0
    else:
        cos, sin = (c.expand(b, t, d).contiguous() for c in pe)
        held, csb = (cos, sin), t * d
    args = (cos.data_ptr(), sin.data_ptr(), csb, config._attn_implementation in C_ATTENTION_FOR)
    _rope_memo[0] = (pe, (b, t, d), args, held, config)
    return args


def layer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                  **kwargs: Any) -> torch.Tensor:
    """fast_forward as two C calls, kq_layer_pre and kq_layer_post, around
    the cache's update: the same routines on the same inputs, so the same
    bits; anything else (see ``plan``, the C attention's conditions, a
    cache of another form, a silu torch would not run vectorized) runs
    fast_forward."""
    x = hidden_states
    p: _Plan = self._specdec_plan  # type: ignore[attr-defined]
    attn = self.self_attn  # type: ignore[attr-defined]
    if "past_key_values" in kwargs and cache is None:
        cache = kwargs.pop("past_key_values")
    if (x.dtype != torch.float32 or x.dim() != 3 or position_embeddings is None
            or position_embeddings[0].dtype != torch.float32 or kwargs.get("output_attentions")
            or not self._specdec_attention  # type: ignore[attr-defined]
            or attn.sliding_window is not None or kwargs.get("position_bias") is not None):
        return fast_forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    b, t, _ = x.shape
    d = p.D
    cos, sin, csb, c_attention = _pass_args(position_embeddings, b, t, d, attn.config)
    if not c_attention or (b * t * p.inter >= _TORCH_GRAIN and torch.get_num_threads() > 1):
        return fast_forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    lib = self._specdec_lib  # type: ignore[attr-defined]
    x = x.contiguous()
    qs = torch.empty((b, p.H, t, d), dtype=torch.float32)
    ks = torch.empty((b, p.Hkv, t, d), dtype=torch.float32)
    vs = torch.empty((b, p.Hkv, t, d), dtype=torch.float32)
    if lib.kq_layer_pre(p.ptr, x.data_ptr(), b, t, cos, sin, csb, qs.data_ptr(), ks.data_ptr(), vs.data_ptr()):
        raise MemoryError("kquant layer: scratch allocation failed")
    if cache is not None:
        ks, vs = cache.update(ks, vs, attn.layer_idx, kwargs=kwargs)
    s = ks.shape[2] if ks.dim() == 4 else -1
    margs = _mask_args(attention_mask, b, t, s)
    kst, vst = ks.stride(), vs.stride()
    if (margs is None or ks.dtype != torch.float32 or vs.dtype != torch.float32 or kst[-1] != 1
            or vst[-1] != 1 or ks.shape != (b, p.Hkv, s, d) or vs.shape != ks.shape):
        return _rest(self, lib, x, qs, ks, vs, attention_mask, kwargs)
    h = torch.empty_like(x)
    rc = lib.kq_layer_post(p.ptr, x.data_ptr(), b, t, qs.data_ptr(), ks.data_ptr(), kst[0], kst[1], kst[2],
                           vs.data_ptr(), vst[0], vst[1], vst[2], s, margs[0], margs[1], margs[2], margs[3],
                           h.data_ptr())
    if rc == 2:
        return _rest(self, lib, x, qs, ks, vs, attention_mask, kwargs)
    if rc:
        raise MemoryError("kquant layer: scratch allocation failed")
    return h


def eligible(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a decoder layer ``fast_forward`` computes exactly
    as its own forward (up to RMSNorm's sum order)."""
    if type(layer).__name__ != "Qwen2DecoderLayer":
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    cfg = getattr(attn, "config", None)
    if cfg is None or getattr(cfg, "hidden_act", None) != "silu" or type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if type(norm).__name__ != "Qwen2RMSNorm" or norm.weight.dtype != torch.float32:
            return False
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    kinds = (kquant.KQuantLinear, kquant.FusedSlice)
    if not all(isinstance(m, kinds) for m in linears):
        return False
    return attn.head_dim % 2 == 0


#: the attention implementations whose computation kq_attention replaces
#: (softmax attention over the masked keys, no dropout)
C_ATTENTION_FOR = ("sdpa", "eager", "specdec_sdpa")


def install(model: torch.nn.Module, c_attention: bool = True, two_calls: bool = True) -> int:
    """Switches every eligible decoder layer of ``model`` (kquant linear
    layers) to ``fast_forward``, with ``kq_attention`` in place of the
    model's attention function when ``c_attention`` (and the model runs one
    of C_ATTENTION_FOR), as ``layer_forward``'s two C calls when
    ``two_calls`` (and ``plan`` takes the layer); returns how many layers."""
    which = None
    for mod in model.modules():
        if isinstance(mod, kquant.KQuantLinear):
            which = mod.which
            break
    if which is None:
        return 0
    n = 0
    for mod in model.modules():
        if eligible(mod) and not hasattr(mod, "_specdec_eager_forward"):
            mod._specdec_eager_forward = mod.forward  # type: ignore[assignment]
            mod._specdec_lib = _lib(which)  # type: ignore[assignment]
            mod._specdec_attention = c_attention  # type: ignore[assignment]
            mod._specdec_plan = plan(mod) if two_calls else None  # type: ignore[assignment]
            fn = layer_forward if mod._specdec_plan is not None else fast_forward
            mod.forward = types.MethodType(fn, mod)  # type: ignore[method-assign]
            n += 1
    return n


def uninstall(model: torch.nn.Module) -> int:
    """Back to transformers' forward (for comparisons); returns how many layers."""
    n = 0
    for mod in model.modules():
        if hasattr(mod, "_specdec_eager_forward"):
            mod.forward = mod._specdec_eager_forward  # type: ignore[method-assign]
            del mod._specdec_eager_forward
            del mod._specdec_lib
            del mod._specdec_attention
            del mod._specdec_plan
            n += 1
    return n
