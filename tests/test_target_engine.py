"""The target engine on a tiny real Qwen2 model, without gRPC: plain decoding
equals transformers' greedy ``generate``, KV-cache rollback after partial
acceptance is exact, and bad inputs raise the right domain errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.sampling import SamplingConfig
from target_service.engine import TargetEngine


@pytest.fixture(scope="module")
def tiny_dir(tiny_models) -> Path:  # type: ignore[no-untyped-def]
    return tiny_models.target


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> TargetEngine:
    return TargetEngine(tiny_dir, dtype="float32", max_sessions=8, kv_budget_tokens=4096)


def test_plain_decoding_equals_hf_generate(engine: TargetEngine, tiny_dir: Path) -> None:
    prompt = [3, 5, 7, 9, 11]
    out = engine.prefill(prompt, SamplingConfig(), True)
    tokens, cache_len, nxt = [], out.cache_len, out.next_token
    sid = out.session_id
    for _ in range(20):
        tokens.append(nxt)
        v = engine.verify(sid, cache_len, [nxt], [], [])
        cache_len, nxt = v.cache_len, v.result.next_token
    engine.release(sid)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert tokens == ref


def test_rollback_after_partial_acceptance_matches_fresh_forward(engine: TargetEngine, tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    committed = [1, 2, 3, 4]
    out = engine.prefill(committed, SamplingConfig(), True)
    sid, cache_len, nxt = out.session_id, out.cache_len, out.next_token
    committed.append(nxt)
    rng = np.random.default_rng(0)
    saw_partial = False
    for _ in range(12):
        # draft = the true greedy continuation with one corrupted position
        with torch.no_grad():
            cont = model.generate(torch.tensor([committed]), max_new_tokens=4, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(committed):].tolist()
        bad = int(rng.integers(0, 5))
        draft = list(cont)
        if bad < 4:
            draft[bad] = (draft[bad] + 1) % engine.vocab_size
        v = engine.verify(sid, cache_len, [committed[-1]] if cache_len == len(committed) - 1 else committed[cache_len:], draft, [])
        expected_accept = bad if bad < 4 else 4
        assert v.result.num_accepted == expected_accept
        if 0 < expected_accept < 4:
            saw_partial = True
        committed += draft[: v.result.num_accepted] + [v.result.next_token]
        assert v.cache_len == len(committed) - 1
        cache_len = v.cache_len
    assert saw_partial
    # the session's cache must now equal a fresh prefill of committed[:-1]
    fresh = engine.prefill(committed[:-1], SamplingConfig(), True)
    mine = engine.verify(sid, cache_len, [committed[-1]], [], [])
    theirs = engine.verify(fresh.session_id, fresh.cache_len, [committed[-1]], [], [])
    assert mine.result.next_token == theirs.result.next_token
    assert mine.logit_gaps == pytest.approx(theirs.logit_gaps, abs=1e-4)
    engine.release(sid)
    engine.release(fresh.session_id)


def test_bad_inputs(engine: TargetEngine) -> None:
    with pytest.raises(InvalidArgument):
        engine.prefill([], SamplingConfig(), True)
    with pytest.raises(InvalidArgument):
        engine.prefill([engine.vocab_size], SamplingConfig(), True)
    with pytest.raises(InvalidArgument):
        engine.prefill([1] * 600, SamplingConfig(), True)  # context is 512
    out = engine.prefill([1, 2], SamplingConfig(temperature=1.0), True)
    sid = out.session_id
    with pytest.raises(FailedPrecondition):
        engine.verify(sid, out.cache_len + 1, [1], [], [])
    with pytest.raises(InvalidArgument):
        engine.verify(sid, out.cache_len, [], [], [])
    with pytest.raises(InvalidArgument):
        engine.verify(sid, out.cache_len, [1], [2, 3], [None])  # q count mismatch
    bad_q = [
        (np.array([2, 3]), np.array([0.5, 0.6], dtype=np.float32)),  # sum != 1
        (np.array([2, 2]), np.array([0.5, 0.5], dtype=np.float32)),  # duplicate ids
        (np.array([2, 3]), np.array([np.nan, 1.0], dtype=np.float32)),
        (np.array([2, 3]), np.array([-0.5, 1.5], dtype=np.float32)),
        (np.array([3, 4]), np.array([0.5, 0.5], dtype=np.float32)),  # drafted 2 not in support
        (np.array([2, 99]), np.array([0.5, 0.5], dtype=np.float32)),  # id out of range
        (np.array([2]), np.array([0.5, 0.5], dtype=np.float32)),  # length mismatch
    ]
    for q in bad_q:
        with pytest.raises(InvalidArgument):
            engine.verify(sid, out.cache_len, [1], [2], [q])
    # the session is untouched by the rejected calls
    v = engine.verify(sid, out.cache_len, [1], [], [])
    assert v.cache_len == out.cache_len + 1
    assert engine.release(sid)
    assert not engine.release(sid)
    with pytest.raises(NotFound):
        engine.verify(sid, 0, [1], [], [])


def test_kv_budget_evicts_least_recently_used(tiny_dir: Path) -> None:
    eng = TargetEngine(tiny_dir, dtype="float32", max_sessions=8, kv_budget_tokens=30, protect_active_s=0.0)  # plain LRU
    a = eng.prefill([1] * 12, SamplingConfig(), True)
    b = eng.prefill([2] * 12, SamplingConfig(), True)
    c = eng.prefill([3] * 12, SamplingConfig(), True)  # evicts a
    with pytest.raises(NotFound):
        eng.verify(a.session_id, a.cache_len, [1], [], [])
    eng.verify(b.session_id, b.cache_len, [1], [], [])
    eng.verify(c.session_id, c.cache_len, [1], [], [])
    assert eng.evictions == 1 and eng.num_sessions == 2


@pytest.mark.parametrize("protect_s", [10.0, 0.0])
def test_a_new_session_does_not_evict_active_ones(tiny_dir: Path, protect_s: float) -> None:
    """Admission past the KV budget: with ``protect_active_s`` a new session
    whose prompt does not fit is refused with RESOURCE_EXHAUSTED and the
    running session keeps its cache; with 0 it evicts the LRU session
    (which then answers NOT_FOUND and is rebuilt by the orchestrator)."""
    eng = TargetEngine(tiny_dir, dtype="float32", max_sessions=8, kv_budget_tokens=100, protect_active_s=protect_s)
    a = eng.prefill([1 + i % 30 for i in range(60)], SamplingConfig(), True)
    if protect_s:
        with pytest.raises(ResourceExhausted, match="active"):
            eng.prefill([2 + i % 30 for i in range(60)], SamplingConfig(), True)
        out = eng.verify(a.session_id, a.cache_len, [a.next_token], [], [])  # type: ignore[list-item]
        assert out.cache_len == 61 and eng.num_sessions == 1
    else:
        b = eng.prefill([2 + i % 30 for i in range(60)], SamplingConfig(), True)
        with pytest.raises(NotFound):
            eng.verify(a.session_id, a.cache_len, [a.next_token], [], [])  # type: ignore[list-item]
        assert eng.num_sessions == 1 and eng.evictions == 1 and b.cache_len == 60


def test_verify_attention_packs_query_heads_and_is_bit_identical(engine: TargetEngine) -> None:
    """The engine's CPU model runs grouped-query attention without copying
    K/V per query head (target_service/attention.py); a verify-shaped pass
    (k > 1 tokens behind a cache, so with a mask) gives the logits of
    transformers' own SDPA path: bit-identical from 17 tokens of context on,
    within rounding at a 3-token context."""
    from transformers import DynamicCache

    from target_service.attention import NAME

    model = engine.model
    assert model.config._attn_implementation == NAME
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # the tiny model is GQA
    g = torch.Generator().manual_seed(5)
    try:
        for ctx, k in ((3, 2), (17, 5), (40, 9)):
            prompt = torch.randint(1, engine.vocab_size, (1, ctx), generator=g)
            ids = torch.randint(1, engine.vocab_size, (1, k), generator=g)
            out = {}
            for impl in (NAME, "sdpa"):
                model.set_attn_implementation(impl)
                cache = DynamicCache(config=model.config)
                with torch.inference_mode():
                    model(input_ids=prompt, use_cache=True, past_key_values=cache)
                    out[impl] = model(input_ids=ids, use_cache=True, logits_to_keep=k, past_key_values=cache).logits
            # the same math; SDPA may block a 4-row pass differently from a
            # 2-row one, so the smallest shape agrees to rounding only
            if ctx >= 17:
                assert torch.equal(out[NAME], out["sdpa"]), (ctx, k)
            assert (out[NAME] - out["sdpa"]).abs().max().item() < 1e-5, (ctx, k)
            assert torch.equal(out[NAME].argmax(-1), out["sdpa"].argmax(-1))
    finally:
        model.set_attn_implementation(NAME)
