"""One session's pass as a plain loop over the kquant two-call layers
(target_service/fast_stack.py): the logits of transformers' model forward
through the same layers, bit for bit, over a session's life (prompt, steps,
k-token verifies, a rollback, a cache set from a prefix hit), on both kernel
builds; and where it does not apply (a hook, a cache layer of another kind,
layers not on the two calls, a pass torch would split) it returns None with
the cache untouched, and runner.forward runs the model as before.
"""

from __future__ import annotations

import pytest
import torch

from target_service import fast_stack, fastlayers, kquant, runner
from target_service import kv_adapter as kv
from tests.test_fastlayers import BUILDS, fast_model, tiny_kquant  # noqa: F401  (fast_model: a fixture)

pytestmark = pytest.mark.skipif(kquant.isa() is None or not kquant.available()[0],
                                reason="kquant kernel unavailable (needs AVX2+FMA and a C compiler)")

CPU = torch.device("cpu")
#: the token stream of the session the tests replay
TOKENS = [int(x) for x in torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(12))]


def session(m, stack: bool) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A session's passes: a 9-token prompt, a step, a 4-token verify, a
    rollback of 2 and a 3-token verify, then a new cache holding a copy of
    the first 7 tokens (a prefix hit: layers set from outside) and 2 tokens
    on it. ``stack``: fast_stack.forward, which must apply to every pass;
    else transformers' forward through the same layers."""

    def run(cache: kv.DynamicCache, ids: list[int], keep: int) -> torch.Tensor:
        if stack:
            out = fast_stack.forward(m, cache, ids, keep)
            assert out is not None, "fast_stack.forward stepped aside"
            return out
        fast_stack.ENABLED = False
        try:
            return runner.forward(m, CPU, "cache", cache, ids, keep)
        finally:
            fast_stack.ENABLED = True

    outs = []
    with torch.inference_mode():
        cache = kv.new_cache(m.config)
        outs.append(run(cache, TOKENS[:9], 9))
        outs.append(run(cache, TOKENS[9:10], 1))
        outs.append(run(cache, TOKENS[10:14], 4))
        kv.drop_last(cache, 2)
        outs.append(run(cache, TOKENS[14:17], 3))
        assert kv.length(cache) == 15
        hit = kv.new_cache(m.config)
        for li in range(kv.num_layers(cache)):
            k, v = kv.layer_kv(cache, li)
            kv.set_layer_kv(hit, li, k[:, :, :7].clone(), v[:, :, :7].clone())
        outs.append(run(hit, TOKENS[20:22], 2))
        outs.append(run(cache, TOKENS[22:23], 1))  # the first session goes on after the copy
    return outs


@pytest.mark.parametrize("backend", ["kquant", "kquant-a8"])
def test_the_stack_loop_gives_the_layer_paths_logits_bit_for_bit(fast_model, backend: str,  # type: ignore[no-untyped-def]
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _, hf, gguf = fast_model
    for build in BUILDS:
        m = tiny_kquant(hf, gguf, build, backend, True, monkeypatch)
        new, old = session(m, True), session(m, False)
        assert len(new) == len(old) == 6
        for i, (a, b) in enumerate(zip(new, old)):
            assert a.dtype == torch.float32 and a.shape == b.shape, i
            assert torch.equal(a, b), (build, i)
        # a verify's rows are one-token steps' rows: the kernel's causal mask is the model's
        assert torch.equal(new[2][:2], session_rows(m, 10, 12)), build


def session_rows(m, start: int, end: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Rows start..end-1 of the session's token stream, one step at a time
    on the stack loop (the same tokens as ``session``)."""
    rows = []
    with torch.inference_mode():
        cache = kv.new_cache(m.config)
        fast_stack.forward(m, cache, TOKENS[:start], 1)
        for i in range(start, end):
            out = fast_stack.forward(m, cache, TOKENS[i:i + 1], 1)
            assert out is not None
            rows.append(out[0])
    return torch.stack(rows)


def test_the_stack_loop_steps_aside_untouched(fast_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    m, _, _ = fast_model
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        ref_cache = kv.new_cache(m.config)
        ref = runner.forward(m, CPU, "cache", ref_cache, ids, 2)

        def declines(cache: kv.DynamicCache) -> None:
            before = kv.length(cache)
            assert fast_stack.forward(m, cache, ids, 2) is None
            assert kv.length(cache) == before
            out = runner.forward(m, CPU, "cache", cache, ids, 2)
            assert torch.equal(out, ref)

        # a forward hook on a layer must see its call
        seen = []
        handle = m.model.layers[1].register_forward_hook(lambda *_: seen.append(1))
        try:
            declines(kv.new_cache(m.config))
            assert seen == [1]
        finally:
            handle.remove()
        # a cache whose layers are transformers' own (it concatenates)
        from transformers import DynamicCache
        declines(DynamicCache(config=m.config))
        # a pass torch would split over its threads (layer_forward runs fast_forward there)
        with monkeypatch.context() as mp:
            mp.setattr(fastlayers, "_TORCH_GRAIN", 8 * 512)
            mp.setattr(torch, "get_num_threads", lambda: 2)
            declines(kv.new_cache(m.config))
        # the layers on fast_forward (no two-call plan)
        fastlayers.uninstall(m)
        fastlayers.install(m, two_calls=False)
        try:
            declines(kv.new_cache(m.config))
        finally:
            fastlayers.uninstall(m)
            fastlayers.install(m)
        # and it applies again
        cache = kv.new_cache(m.config)
        out = fast_stack.forward(m, cache, ids, 2)
        assert out is not None and torch.equal(out, ref) and kv.length(cache) == len(ids)


def test_the_engine_runs_a_sessions_passes_on_the_stack_loop(fast_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Through TargetEngine (the service's path: its sessions' caches, its
    prefill and verify) every single-session pass takes the stack loop, and
    greedy verification gives the tokens of transformers' loop."""
    from specdec.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    _, hf, gguf = fast_model
    eng = TargetEngine(hf, dtype="bfloat16", backend="kquant-a8", gguf_path=gguf)
    taken: list[bool] = []
    real = fast_stack.forward

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fast_stack, "forward", counting)

    def decode(stack: bool) -> list[int]:
        monkeypatch.setattr(fast_stack, "ENABLED", stack)
        pre = eng.prefill([3, 9, 14, 2, 7, 1], SamplingConfig(), sample_next=True)
        assert pre.next_token is not None
        toks, n, new = [pre.next_token], 6, [pre.next_token]
        for i in range(6):
            draft = toks[-2:] if i % 2 else []  # some multi-token verifies (their drafts mostly rejected)
            out = eng.verify(pre.session_id, n, new, draft, [None] * len(draft))
            n += len(new) + out.result.num_accepted
            new = [out.result.next_token]
            toks += draft[: out.result.num_accepted] + new
        eng.release(pre.session_id)
        return toks

    on = decode(True)
    assert taken and all(taken), taken
    taken.clear()
    off = decode(False)
    assert not taken  # the switch keeps runner.forward off the stack loop
    assert on == off


def test_a_failed_stack_call_leaves_the_cache_as_it_was(fast_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Should the kernel's call fail (scratch it cannot allocate), the error
    says so and no layer holds the pass's tokens; the session goes on as if
    the pass had not been tried."""
    m, _, _ = fast_model
    layer0 = m.model.layers[0]
    real = layer0._specdec_lib

    class Failing:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return (lambda *a: 1) if name == "kq_stack" else getattr(real, name)

    with torch.inference_mode():
        cache, ref = kv.new_cache(m.config), kv.new_cache(m.config)
        fast_stack.forward(m, cache, [3, 1, 4, 1], 1)
        fast_stack.forward(m, ref, [3, 1, 4, 1], 1)
        monkeypatch.setattr(layer0, "_specdec_lib", Failing())
        with pytest.raises(MemoryError, match="scratch allocation failed"):
            fast_stack.forward(m, cache, [5, 9], 2)
        assert kv.length(cache) == 4
        monkeypatch.setattr(layer0, "_specdec_lib", real)
        assert torch.equal(fast_stack.forward(m, cache, [2, 6], 2), fast_stack.forward(m, ref, [2, 6], 2))
