"""The kquant decoder layer's fused small ops (target_service/fastlayers.py,
kquant.c): RMSNorm to float32 rounding of torch's (its sum in its own fixed
order), rotary embedding bit for bit as transformers', attention to float32
rounding of SDPA; each of them the same bits for a row whatever the rows,
the batch or the padding beside it and on both kernel builds; and a tiny
quantized Qwen2 whose logits for a prompt equal, bit for bit, those of its
one-token steps, its k-token passes and a left-padded batch.
"""

from __future__ import annotations

import pytest
import torch

from target_service import fastlayers, kquant, quant

BUILDS = [b for b in ("avx512bf16", "avx2") if b == "avx2" or kquant.isa() == "avx512bf16"]
pytestmark = pytest.mark.skipif(kquant.isa() is None or not kquant.available()[0],
                                reason="kquant kernel unavailable (needs AVX2+FMA and a C compiler)")


def lib(build: str):  # type: ignore[no-untyped-def]
    return fastlayers._lib(build)


def torch_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    n = Qwen2RMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        n.weight.copy_(w)
        return n(x)


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("build", BUILDS)
def test_rmsnorm_is_torchs_to_float32_rounding_and_adds_the_residual_exactly(build: str) -> None:
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(9, 1536, generator=g) * 3, torch.randn(9, 1536, generator=g), torch.randn(1536, generator=g)
    ref = torch_rmsnorm(x, w, 1e-6)
    h, y = fastlayers.rmsnorm(lib(build), x, w, 1e-6)
    assert h is x
    # only the sum of squares is in another order: a few ulp of float32
    assert ((y - ref).abs() <= 4e-7 * ref.abs() + 1e-30).all()
    # negative control: the order differs from torch's, and the check sees it
    assert not torch.equal(y, ref)
    assert not ((y * (1 + 2e-6) - ref).abs() <= 4e-7 * ref.abs()).all()
    h, y = fastlayers.rmsnorm(lib(build), x, w, 1e-6, residual=r)
    assert torch.equal(h, x + r)  # the residual add: the same float32 sum as torch's
    assert ((y - torch_rmsnorm(x + r, w, 1e-6)).abs() <= 4e-7 * y.abs() + 1e-30).all()


def test_rmsnorm_rows_are_independent_and_the_same_on_both_builds() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(12, 1536, generator=g), torch.randn(1536, generator=g)
    outs = []
    for build in BUILDS:
        _, y = fastlayers.rmsnorm(lib(build), x, w, 1e-6)
        for i in range(12):
            assert torch.equal(fastlayers.rmsnorm(lib(build), x[i:i + 1], w, 1e-6)[1], y[i:i + 1])
        outs.append(y)
    assert all(torch.equal(o, outs[0]) for o in outs)


# ------------------------------------------------------------------- rotary
@pytest.mark.parametrize("build", BUILDS)
def test_rope_is_transformers_rotary_embedding_bit_for_bit(build: str) -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    b, t, h, hkv, d = 2, 5, 6, 2, 64
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=g)  # a fused projection's output
    ang = torch.rand(b, t, d // 2, generator=g) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    q, k = qkv[..., :h * d], qkv[..., h * d:(h + hkv) * d]  # column slices: row stride (h + 2 hkv) d
    ref_q, ref_k = apply_rotary_pos_emb(q.reshape(b, t, h, d).transpose(1, 2),
                                        k.reshape(b, t, hkv, d).transpose(1, 2), cos, sin)
    for src, heads, ref in ((q, h, ref_q), (k, hkv, ref_k)):
        out = torch.empty(b, heads, t, d)
        lib(build).kq_rope(src.data_ptr(), src.stride(1), b, t, heads, d, cos.data_ptr(), sin.data_ptr(),
                           out.data_ptr())
        assert torch.equal(out, ref)
    # the values: the same columns, moved to [B, H, T, D]
    v = qkv[..., (h + hkv) * d:]
    out = torch.empty(b, hkv, t, d)
    lib(build).kq_heads(v.data_ptr(), v.stride(1), b, t, hkv, d, out.data_ptr())
    assert torch.equal(out, v.reshape(b, t, hkv, d).transpose(1, 2))


# ---------------------------------------------------------------- attention
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                           scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [B, T, H, D]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("t,s", [(1, 37), (1, 300), (8, 300), (5, 5)])
def test_attention_is_sdpa_to_float32_rounding(build: str, t: int, s: int) -> None:
    g = torch.Generator().manual_seed(4)
    b, h, hkv, d = 2, 12, 2, 128
    q = torch.randn(b, h, t, d, generator=g) * 2
    kbuf, vbuf = torch.randn(b, hkv, s + 40, d, generator=g), torch.randn(b, hkv, s + 40, d, generator=g)
    k, v = kbuf[:, :, :s], vbuf[:, :, :s]  # views of a longer buffer, as a growing cache's
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
    mask[1, :, :, :3] = False  # batch row 1: three padding positions
    out = fastlayers.attention(lib(build), q, k, v, mask, d ** -0.5)
    assert out is not None and out.shape == (b, t, h, d)
    ref = sdpa(q, k, v, mask, d ** -0.5)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # the causal default (no mask) is the bottom-right causal mask
    causal = fastlayers.attention(lib(build), q, k, v, None, d ** -0.5)
    assert torch.equal(causal[0], out[0])


def test_attention_rows_do_not_depend_on_the_rows_padding_or_build_beside_them() -> None:
    g = torch.Generator().manual_seed(5)
    b, h, hkv, d, t, s = 2, 12, 2, 128, 6, 90
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    pad = 11
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
    mask[1, :, :, :pad] = False
    outs = []
    for build in BUILDS:
        for threads in (1, 2):
            kquant._library(build)[0].kq_set_threads(threads)  # type: ignore[union-attr]
            out = fastlayers.attention(lib(build), q, k, v, mask, d ** -0.5)
            assert out is not None
            for i in range(t):  # each query row alone, over the keys it sees (a 1-token step)
                s_i = s - t + i + 1
                one = fastlayers.attention(lib(build), q[:, :, i:i + 1].contiguous(), k[:, :, :s_i], v[:, :, :s_i],
                                           mask[:, :, i:i + 1, :s_i], d ** -0.5)
                assert one is not None and torch.equal(one[:, 0], out[:, i]), (build, i)
            # batch row 1 without its left padding
            alone = fastlayers.attention(lib(build), q[1:].contiguous(), k[1:, :, pad:], v[1:, :, pad:], None,
                                         d ** -0.5)
            assert alone is not None and torch.equal(alone[0], out[1])
            outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    kquant.set_threads(2)
    # negative controls: a masked key's value changes nothing, an attended one changes the rows that see it
    v2 = v.clone()
    v2[1, :, 0] += 5.0  # padding of batch row 1
    v2[0, :, s - 1] += 5.0  # the last key: seen by row t - 1 of batch row 0 only
    changed = fastlayers.attention(lib(BUILDS[0]), q, k, v2, mask, d ** -0.5)
    assert changed is not None
    assert torch.equal(changed[1], outs[0][1]) and torch.equal(changed[0, :t - 1], outs[0][0, :t - 1])
    assert not torch.equal(changed[0, t - 1], outs[0][0, t - 1])


# ------------------------------------------------------- a tiny Qwen2, served
@pytest.fixture(scope="module")
def fast_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_CHARS
    from tests.gguf_tiny import quantize_tiny_model
    from tests.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("fast-layers")
    hf = build_tiny_model(root / "hf", chars=TINY_CHARS, seed=23, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2)
    gguf = quantize_tiny_model(hf, root / "model.gguf")
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    m.set_attn_implementation("sdpa")
    with torch.inference_mode():
        counts = quant.apply_quant(m, "kquant", gguf)
    assert counts["fast_layers"] == m.config.num_hidden_layers
    return m, hf, gguf


def test_fast_layers_compute_transformers_layers_to_float32_rounding(fast_model) -> None:  # type: ignore[no-untyped-def]
    """The whole model against transformers' layers (the wiring: norms,
    rope, attention, residuals, MLP in place). The parts differ from torch's
    in the last float32 bits (tested one by one above), and the kernel rounds
    its activations to bf16, so a last-bit difference at a linear layer's
    input can move one activation by one bf16 step (2^-8 relative) and that
    spreads: on AVX2, where torch's RMSNorm sums in 8 lanes, not the
    kernel's 16, it does (1.1e-3 of the largest logit; an RMSNorm epsilon
    of 1e-2 in one layer instead of 1e-6 moves them by 6.2e-3). So the
    bound is one bf16 step of the largest logit, with greedy argmax the same
    at every position."""
    m, _, _ = fast_model
    ids = torch.randint(1, 30, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        fast = m(input_ids=ids).logits
        assert fastlayers.uninstall(m) == m.config.num_hidden_layers
        try:
            eager = m(input_ids=ids).logits
        finally:
            fastlayers.install(m)
    assert (fast - eager).abs().max() <= 2**-8 * eager.abs().max()
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_fast_layers_give_a_row_the_same_logits_whatever_the_pass(fast_model) -> None:  # type: ignore[no-untyped-def]
    """A prompt's logits bit for bit as its one-token steps', its k-token
    passes' and a left-padded batch's (the rows of a step, a verify and a
    batched verify are one computation)."""
    from target_service import kv_adapter

    m, _, _ = fast_model
    ids = torch.randint(1, 30, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        full = m(input_ids=ids).logits[0]
        for chunk in (1, 3, 8):
            cache = kv_adapter.new_cache(m.config)
            rows = [m(input_ids=ids[:, :6], cache=cache).logits[0]]
            for i in range(6, 24, chunk):
                rows.append(m(input_ids=ids[:, i:i + chunk], cache=cache).logits[0])
            assert torch.equal(torch.cat(rows), full), chunk
        # a batch: this prompt beside a longer one, left-padded by 5
        other = torch.randint(1, 30, (1, 29), generator=torch.Generator().manual_seed(8))
        batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1), other])
        attn = torch.ones_like(batch)
        attn[0, :5] = 0
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        out = m(input_ids=batch, attention_mask=attn, position_ids=pos).logits
        assert torch.equal(out[0, 5:], full)
        assert torch.equal(out[1], m(input_ids=other).logits[0])
        # negative control: a different token earlier changes the rows after it
        ids2 = ids.clone()
        ids2[0, 10] = (ids2[0, 10] % 29) + 1
        again = m(input_ids=ids2).logits[0]
        assert torch.equal(again[:10], full[:10]) and not torch.equal(again[10:], full[10:])


def test_the_calibration_identity_names_the_layer_path() -> None:
    from target_service.calibration import machine_identity

    assert machine_identity(torch.device("cpu"))["layers"] == fastlayers.IDENTITY


def test_apply_quant_can_leave_transformers_layers(fast_model) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    _, hf, gguf = fast_model
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.inference_mode():
        counts = quant.apply_quant(m, "kquant", gguf, fast_layers=False)
    assert counts.get("fast_layers", 0) == 0
    assert not any(hasattr(x, "_specdec_eager_forward") for x in m.modules())


# --------------------------------------------- the layer in two C calls
@pytest.mark.parametrize("build", BUILDS)
def test_silu_mul_is_torchs_silu_then_mul_bit_for_bit(build: str) -> None:
    """kq_silu_mul is torch's float32 ``silu(gate).mul_(up)`` (its
    vectorized loop: SLEEF's expf), bit for bit: random rows of a fused
    gate/up output, and the edges of exp's range (an exhaustive check over
    all 2^32 float32 inputs found no difference on either build)."""
    g = torch.Generator().manual_seed(9)
    m, inter = 7, 512
    gu = torch.randn(m, 2 * inter, generator=g) * torch.logspace(-3, 2.2, m)[:, None]
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 88.0, 89.0, 100.0, 100.5, -87.0, -88.7, -103.9,
                          -104.0, -104.1, -150.0, 3e38, -3e38, float("inf"), -float("inf")])
    gu[0, :len(edges)] = edges
    gate, up = gu[:, :inter], gu[:, inter:]
    ref = torch.nn.functional.silu(gate).mul_(up)
    out = torch.empty(m, inter)
    lib(build).kq_silu_mul(gate.data_ptr(), gu.stride(0), up.data_ptr(), gu.stride(0), m, inter, out.data_ptr())
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    # negative control: silu with a correctly rounded exp differs in the last bits
    near = (gate.double() / (1 + torch.exp(-gate.double()))).float() * up
    assert not torch.equal(near, ref)


def tiny_kquant(hf, gguf, build: str, backend: str, fuse: bool, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    m.set_attn_implementation("sdpa")
    with monkeypatch.context() as mp, torch.inference_mode():
        mp.setattr(kquant, "isa", lambda: build)  # the kernel build the layers are packed for
        counts = quant.apply_quant(m, backend, gguf, fuse=fuse)
    assert counts["fast_layers"] == m.config.num_hidden_layers
    return m


def passes(m, ids: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A prompt's logits, its 1-token steps', its 3- and 8-token passes' and
    a left-padded batch's (this prompt beside a longer one)."""
    from target_service import kv_adapter

    outs = [m(input_ids=ids).logits[0]]
    for chunk in (1, 3, 8):
        cache = kv_adapter.new_cache(m.config)
        rows = [m(input_ids=ids[:, :6], cache=cache).logits[0]]
        for i in range(6, ids.shape[1], chunk):
            rows.append(m(input_ids=ids[:, i:i + chunk], cache=cache).logits[0])
        outs.append(torch.cat(rows))
    other = torch.randint(1, 30, (1, ids.shape[1] + 5), generator=torch.Generator().manual_seed(8))
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1), other])
    attn = torch.ones_like(batch)
    attn[0, :5] = 0
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    out = m(input_ids=batch, attention_mask=attn, position_ids=pos).logits
    return outs + [out[0, 5:], out[1]]


@pytest.mark.parametrize("backend,fuse", [("kquant", True), ("kquant", False), ("kquant-a8", True)])
def test_two_call_layers_are_the_fused_layers_bit_for_bit(fast_model, backend: str, fuse: bool,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """layer_forward (kq_layer_pre, kq_layer_post) gives fast_forward's
    logits bit for bit for a prompt, its steps, its k-token passes and a
    left-padded batch, on both kernel builds, with fused and separate
    projections; a row's logits are the same in every pass; and with the
    8-bit activations (the same bits on both builds) the same on both."""
    _, hf, gguf = fast_model
    ids = torch.randint(1, 30, (1, 24), generator=torch.Generator().manual_seed(10))
    first = None
    for build in BUILDS:
        m = tiny_kquant(hf, gguf, build, backend, fuse, monkeypatch)
        plans = [layer._specdec_plan for layer in m.model.layers]
        assert all(p is not None for p in plans)
        assert {p.struct.nqkv for p in plans} == ({2} if fuse else {3})  # v (Q6_K) apart from q/k (Q4_K)
        assert {p.struct.ngu for p in plans} == ({1} if fuse else {2})
        with torch.inference_mode(), monkeypatch.context() as mp:
            def refuse(*_a, **_k):  # type: ignore[no-untyped-def]
                raise AssertionError("layer_forward fell back")
            mp.setattr(fastlayers, "fast_forward", refuse)
            mp.setattr(fastlayers, "_rest", refuse)
            new = passes(m, ids)
        assert fastlayers.uninstall(m) == m.config.num_hidden_layers
        fastlayers.install(m, two_calls=False)
        assert all(layer.forward.__func__ is fastlayers.fast_forward for layer in m.model.layers)
        with torch.inference_mode():
            old = passes(m, ids)
        for a, b in zip(new, old):
            assert torch.equal(a, b)
        for rows in new[1:5]:
            assert torch.equal(rows, new[0])
        if first is None:
            first = new
        elif backend == "kquant-a8":  # its linear layers give the same bits on both builds, so do the layers
            assert all(torch.equal(a, b) for a, b in zip(new, first))
        else:  # the bf16 builds' linear layers sum in different orders (kquant.py)
            assert not torch.equal(new[0], first[0])
    # negative control: another token earlier changes the rows after it on this path too
    ids2 = ids.clone()
    ids2[0, 10] = (ids2[0, 10] % 29) + 1
    with torch.inference_mode():
        fastlayers.uninstall(m)
        fastlayers.install(m)
        again = m(input_ids=ids2).logits[0]
    assert torch.equal(again[:10], new[0][:10]) and not torch.equal(again[10:], new[0][10:])


def test_two_call_layers_fall_back_to_fast_forward(fast_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """What the two calls do not take runs fast_forward: the model's own
    attention (c_attention=False), and a silu torch would split over its
    threads mid-row (several threads, a large pass)."""
    m, _, _ = fast_model
    calls = []
    real = fastlayers.fast_forward

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    ids = torch.randint(1, 30, (1, 24), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        ref = m(input_ids=ids).logits
        monkeypatch.setattr(fastlayers, "fast_forward", counting)
        fastlayers.uninstall(m)
        fastlayers.install(m, c_attention=False)
        try:
            sdpa_out = m(input_ids=ids).logits
            assert len(calls) == m.config.num_hidden_layers
            monkeypatch.setattr(fastlayers, "_TORCH_GRAIN", 24 * 512)
            monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
            fastlayers.uninstall(m)
            fastlayers.install(m)
            calls.clear()
            again = m(input_ids=ids).logits
            assert len(calls) == m.config.num_hidden_layers
            calls.clear()
            m(input_ids=ids[:, :23])  # below the grain: the two calls
            assert not calls
        finally:
            fastlayers.uninstall(m)
            fastlayers.install(m)
    assert torch.equal(again, ref)
    # the model's SDPA against the kernel's attention: float32 rounding, which the bf16
    # activations can move by one bf16 step (test_fast_layers_compute_transformers_layers_...)
    assert (sdpa_out - ref).abs().max() <= 2**-8 * ref.abs().max()
