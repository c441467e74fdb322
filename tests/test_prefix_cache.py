"""The target's prefix cache (target_service/prefix_cache.py): a prompt that
starts with tokens already cached prefills only the rest, a chat's next
turn reuses the previous turn's prompt and generated tokens, and a hit does
not change the output. On the tiny float32 target, in the engine and
through the real services on loopback.

Exactness: under float32 a hit computes the same keys and values over a
different number of rows, so the logits agree to rounding (about 1e-6 on
this model), not bit for bit; the greedy tokens are equal and the top-5
logprobs agree to 1e-5. Bit-identical logits hold under numerics whose
per-row result does not depend on the row count (kquant's int4 kernels).
The negative control stores a wrong prefix's KV under the entry's tokens:
the same comparison then fails, so it can see a hit that reuses the wrong
keys and values."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client import generate_latest

from specdec.sampling import SamplingConfig
from target_service.engine import TargetEngine
from target_service.prefix_cache import PrefixCache, common_prefix
from tests.stack import start_stack

#: a 120-token "system prompt" and two different questions after it (tiny vocabulary ids 1..33)
SYSTEM = [1 + (i * 7 + i // 5) % 33 for i in range(120)]
Q1 = [1 + (i * 5 + 3) % 33 for i in range(20)]
Q2 = [1 + (i * 11 + 1) % 33 for i in range(25)]


def greedy(engine: TargetEngine, prompt: list[int], n: int) -> tuple[list[int], list[float], int, str]:
    """The first ``n`` greedy tokens after ``prompt``, the first token's top-5
    logprobs, the prompt tokens taken from the prefix cache, and the session
    id (released: with the cache on, it becomes an entry)."""
    out = engine.prefill(prompt, SamplingConfig(), True, top_logprobs=5)
    assert out.next_token is not None
    tokens, cache_len = [out.next_token], out.cache_len
    while len(tokens) < n:
        v = engine.verify(out.session_id, cache_len, [tokens[-1]], [], [])
        tokens.append(v.result.next_token)
        cache_len = v.cache_len
    engine.release(out.session_id)
    return tokens, [v for _, v in out.logprobs[0].top], out.cached_tokens, out.session_id


@pytest.fixture(scope="module")
def cold(tiny_models) -> TargetEngine:  # type: ignore[no-untyped-def]
    return TargetEngine(tiny_models.target, dtype="float32", prefix_cache=False)


def test_lookup_takes_the_longest_common_prefix_and_leaves_the_last_token() -> None:
    cache = PrefixCache(max_entries=3, min_hit_tokens=4)
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert cache.store([1, 2, 3, 4, 5, 6], [("k6", "v6")])
    assert cache.store([1, 2, 3, 9, 9, 9, 9, 9], [("k8", "v8")])
    hit = cache.lookup([1, 2, 3, 4, 5, 7, 7])
    assert hit is not None and hit.length == 5 and hit.entry.layers == [("k6", "v6")]
    hit = cache.lookup([1, 2, 3, 4, 5, 6])  # the whole prompt is cached: its last token is still computed
    assert hit is not None and hit.length == 5
    assert cache.lookup([1, 2, 3, 8, 8]) is None  # 3 shared tokens < min_hit_tokens
    assert cache.queries_tokens == 7 + 6 + 5 and cache.hits_tokens == 10
    # an entry the new one extends is dropped; one that covers it is kept instead of it
    assert cache.store([1, 2, 3, 4, 5, 6, 7, 8], [("k", "v")]) and cache.num_entries == 2
    assert not cache.store([1, 2, 3, 4, 5], [("k", "v")]) and cache.num_entries == 2
    assert cache.tokens == 16
    for n in range(3):  # bounded: the least recently used goes first
        cache.store([20 + n] * 6, [("k", "v")])
    assert cache.num_entries == 3 and cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) is None


def test_a_shared_system_prompt_is_prefilled_once_and_the_output_is_unchanged(tiny_models, cold) -> None:  # type: ignore[no-untyped-def]
    """Two requests with the same 120-token system prompt and different
    questions: the second takes the 120 tokens from the cache (and a third
    from the second's finished session too), and every greedy continuation
    equals the one without a prefix cache."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefix_cache=True, prefill_chunk_tokens=32)
    first = greedy(engine, SYSTEM + Q1, 12)
    assert first[2] == 0
    second = greedy(engine, SYSTEM + Q2, 12)
    assert second[2] == len(SYSTEM)
    for prompt, got in ((SYSTEM + Q1, first), (SYSTEM + Q2, second)):
        ref = greedy(cold, prompt, 12)
        assert got[0] == ref[0]
        assert got[1] == pytest.approx(ref[1], abs=1e-5)
    assert engine.prefix is not None and engine.prefix.hits_tokens == len(SYSTEM)


def test_the_next_chat_turn_reuses_the_previous_turns_prompt_and_generated_tokens(tiny_models, cold) -> None:  # type: ignore[no-untyped-def]
    """Turn 2's prompt is turn 1's prompt, its reply and a new message: all
    but the reply's last token (never fed to the cache) come from the cache."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefix_cache=True)
    reply, _, cached, _ = greedy(engine, SYSTEM + Q1, 10)
    assert cached == 0
    turn2 = SYSTEM + Q1 + reply + Q2
    got = greedy(engine, turn2, 10)
    assert got[2] == len(SYSTEM + Q1) + len(reply) - 1
    ref = greedy(cold, turn2, 10)
    assert got[0] == ref[0] and got[1] == pytest.approx(ref[1], abs=1e-5)


def test_negative_control_a_wrong_prefix_is_seen(tiny_models, cold) -> None:  # type: ignore[no-untyped-def]
    """Store the KV of a different 120 tokens under the system prompt's
    tokens: the comparison the tests above make now fails."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefix_cache=True)
    wrong = [1 + (i * 3 + 2) % 33 for i in range(len(SYSTEM))]
    out = engine.prefill(wrong + [5], SamplingConfig(), True)
    sess = engine.kv.get(out.session_id)
    from target_service import kv_adapter as kv

    layers = [kv.layer_kv(sess.cache, li) for li in range(kv.num_layers(sess.cache))]
    assert engine.prefix is not None
    engine.prefix.clear()
    engine.prefix.store(SYSTEM + [5], layers)  # the wrong keys and values under the system prompt's tokens
    got = greedy(engine, SYSTEM + Q1, 12)
    assert got[2] == len(SYSTEM)
    ref = greedy(cold, SYSTEM + Q1, 12)
    assert got[0] != ref[0] or got[1] != pytest.approx(ref[1], abs=1e-5)


def test_entries_count_in_the_budget_and_give_way_before_any_session(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Budget 300 tokens. Released sessions' entries hold their tokens in the
    budget; a new prompt that needs the room drops entries (least recently
    used first), never an idle session while an entry is left, and an entry
    is never stored at a session's expense."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefix_cache=True, kv_budget_tokens=300,
                          protect_active_s=0.0)
    a = engine.prefill(SYSTEM, SamplingConfig(), True)  # A holds 120, and its prompt is stored: 240
    assert engine.kv.used_tokens == 240 and engine.kv.prefix_tokens == 120
    engine.prefill(Q1 * 3, SamplingConfig(), True)  # B: 60; its prompt's entry replaces A's (LRU): 240
    assert engine.kv.used_tokens == 240 and engine.kv.prefix_tokens == 60
    engine.prefill(Q2 * 2, SamplingConfig(), True)  # C: 50; its entry replaces B's: 280
    assert engine.kv.used_tokens == 280 and engine.kv.prefix_tokens == 50
    assert engine.num_sessions == 3 and engine.evictions == 0
    d = engine.prefill([9] * 100, SamplingConfig(), True)  # needs 100: C's entry goes first, then one idle session
    assert engine.evictions == 1 and engine.num_sessions == 3
    with pytest.raises(Exception, match="unknown target session"):
        engine.kv.get(a.session_id)  # the least recently used session
    # D's prompt is not stored: 210 held by sessions + 100 > 300, and no entry is left to give way
    assert engine.kv.prefix_tokens == 0 and engine.kv.used_tokens == 210
    engine.release(d.session_id)
    engine.prefill([7] * 20, SamplingConfig(), True)  # D's session is stored before this batch, then this prompt
    assert engine.kv.prefix_tokens == 100 + 20 and engine.kv.used_tokens == 110 + 20 + 120 <= engine.kv.budget_tokens


def test_through_the_services_the_hit_is_reported_and_counted(tiny_models, onnx_cache_dir) -> None:  # type: ignore[no-untyped-def]
    """Generate twice with the same long prompt prefix: the second request's
    GenerationStats.cached_prompt_tokens is > 0, its text equals the first
    one's, and the target's Prometheus counters show the queries and hits
    in tokens."""
    st = start_stack(tiny_models.target, None, onnx_cache_dir)
    try:
        prompt = "the quick brown fox jumps over the lazy dog. " * 6
        one = st.generate(prompt=prompt + "alpha", max_new_tokens=12, mode="off")
        two = st.generate(prompt=prompt + "alpha", max_new_tokens=12, mode="off")
        three = st.generate(prompt=prompt + "beta", max_new_tokens=12, mode="off")
        assert one["stats"].cached_prompt_tokens == 0
        assert two["stats"].cached_prompt_tokens >= len(prompt) - 2  # one char per token in the tiny vocabulary
        assert three["stats"].cached_prompt_tokens >= len(prompt) - 2
        assert two["token_ids"] == one["token_ids"]
        body = generate_latest(st.target.servicer.metrics.registry).decode()  # what /metrics serves

        def metric(name: str) -> float:
            m = re.search(rf"^{name} (\S+)$", body, re.M)
            assert m, name
            return float(m.group(1))

        hits = metric("specdec_target_prefix_cache_hits_tokens_total")
        assert hits == two["stats"].cached_prompt_tokens + three["stats"].cached_prompt_tokens
        assert metric("specdec_target_prefix_cache_queries_tokens_total") >= 3 * len(prompt)
        assert 0 < metric("specdec_target_kv_used_tokens") <= metric("specdec_target_kv_budget_tokens")
    finally:
        st.close()
