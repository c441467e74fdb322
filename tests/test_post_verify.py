"""PEARL-style post-verify through the real target (tiny float32 Qwen2): a
token drafted at the bonus position is checked against the target's row γ
when the whole span is accepted, is never fed into the cache, and leaves
greedy output unchanged. Engine-level (single and batched forward passes)
and over gRPC on loopback. The sampler's exactness is tested statistically
in tests/test_sampling.py (test_post_verify_joint_distribution)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest

from specdec.errors import InvalidArgument
from specdec.sampling import SamplingConfig, SparseQ, VerifyResult
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.calls import VerifyCall, VerifyOutcome
from target_service.engine import TargetEngine
from tests.stack import LoopThread

PROMPT = [3, 5, 7, 9, 11]
GAMMA = 3
#: temperature 1 with top-k 1: p is one-hot on the argmax, so the sampled
#: path (rejection_sample) is deterministic and its answers are known
TOP1 = SamplingConfig(temperature=1.0, top_k=1, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_models) -> TargetEngine:  # type: ignore[no-untyped-def]
    return TargetEngine(tiny_models.target, dtype="float32", max_sessions=16, kv_budget_tokens=4096)


def greedy_tokens(engine: TargetEngine, prompt: list[int], n: int) -> list[int]:
    """The target's next ``n`` greedy tokens after ``prompt`` (plain decoding
    on a scratch session)."""
    out = engine.prefill(prompt, SamplingConfig(), True)
    assert out.next_token is not None
    tokens, cache_len = [out.next_token], out.cache_len
    while len(tokens) < n:
        v = engine.verify(out.session_id, cache_len, [tokens[-1]], [], [])
        tokens.append(v.result.next_token)
        cache_len = v.cache_len
    engine.release(out.session_id)
    return tokens


def verify_after_prompt(
    engine: TargetEngine, cfg: SamplingConfig, draft: list[int], post_id: int | None, post_q: SparseQ | None = None
) -> tuple[VerifyOutcome, str]:
    """A fresh session on PROMPT, then one Verify of its first token + ``draft``."""
    pre = engine.prefill(PROMPT, cfg, True)
    assert pre.next_token is not None
    out = engine.verify(pre.session_id, pre.cache_len, [pre.next_token], draft, [None] * len(draft), post_id, post_q)
    return out, pre.session_id


@pytest.mark.parametrize("cfg", [SamplingConfig(), TOP1], ids=["greedy", "top1-sampled"])
def test_post_token_accepted_iff_it_is_the_target_token(engine: TargetEngine, cfg: SamplingConfig) -> None:
    """Whole span accepted: the argmax as post token gives next_is_post and
    the same next token, cache_len and logit gaps as without a post token
    (it is not cached: the next round, which sends it as its new token,
    agrees too); a wrong post token gives the same next token, not post."""
    cont = greedy_tokens(engine, PROMPT, GAMMA + 2)  # t0 (prefill), span of GAMMA, the bonus-position token
    draft, target_next = cont[1 : GAMMA + 1], cont[GAMMA + 1]
    wrong = (target_next + 1) % engine.vocab_size
    plain, sid_plain = verify_after_prompt(engine, cfg, draft, None)
    assert plain.result == VerifyResult(GAMMA, target_next, True, False)
    hit, sid_hit = verify_after_prompt(engine, cfg, draft, target_next)
    assert hit.result == VerifyResult(GAMMA, target_next, False, True)
    assert hit.cache_len == plain.cache_len == len(PROMPT) + 1 + GAMMA
    assert hit.logit_gaps == pytest.approx(plain.logit_gaps, abs=1e-5)
    miss, sid_miss = verify_after_prompt(engine, cfg, draft, wrong)
    assert miss.result == VerifyResult(GAMMA, target_next, True, False)
    assert miss.cache_len == plain.cache_len
    # the next round (the post token as its new token) sees the same cache
    nxt = [engine.verify(s, plain.cache_len, [target_next], [], []) for s in (sid_plain, sid_hit, sid_miss)]
    assert len({(o.result, o.cache_len) for o in nxt}) == 1 and nxt[0].cache_len == plain.cache_len + 1
    for s in (sid_plain, sid_hit, sid_miss):
        assert engine.release(s)


@pytest.mark.parametrize("cfg", [SamplingConfig(), TOP1], ids=["greedy", "top1-sampled"])
def test_post_token_with_an_empty_span_and_after_a_rejection(engine: TargetEngine, cfg: SamplingConfig) -> None:
    """γ = 0: the post token is checked against row 0 (the p after the new
    tokens). A span rejected inside ignores the post token: the recovered
    token and cache_len are as without it."""
    cont = greedy_tokens(engine, PROMPT, 3)
    out, sid = verify_after_prompt(engine, cfg, [], cont[1])
    assert out.result == VerifyResult(0, cont[1], False, True) and out.cache_len == len(PROMPT) + 1
    engine.release(sid)
    bad = [(cont[1] + 1) % engine.vocab_size]
    plain, s1 = verify_after_prompt(engine, cfg, bad, None)
    post, s2 = verify_after_prompt(engine, cfg, bad, cont[2])
    assert plain.result == post.result == VerifyResult(0, cont[1], False, False)
    assert post.cache_len == plain.cache_len == len(PROMPT) + 1
    engine.release(s1)
    engine.release(s2)


def test_batched_forward_post_verifies_each_row(engine: TargetEngine) -> None:
    """run_batch with several rows in one forward pass post-verifies each
    row as a single call does (greedy, sampled top-1, a wrong post token,
    one-hot and sparse q)."""
    cont = greedy_tokens(engine, PROMPT, GAMMA + 2)
    draft, target_next = cont[1 : GAMMA + 1], cont[GAMMA + 1]
    wrong = (target_next + 1) % engine.vocab_size
    q = (np.array([target_next, 0], dtype=np.int64), np.array([0.75, 0.25], dtype=np.float32))
    cases = [  # (cfg, draft, post_id, post_q, expected)
        (SamplingConfig(), draft, target_next, None, VerifyResult(GAMMA, target_next, False, True)),
        (TOP1, draft, target_next, q, VerifyResult(GAMMA, target_next, False, True)),
        (TOP1, draft[:1], cont[2], None, VerifyResult(1, cont[2], False, True)),
        (SamplingConfig(), draft, wrong, None, VerifyResult(GAMMA, target_next, True, False)),
    ]
    pres = [engine.prefill(PROMPT, cfg, True) for cfg, *_ in cases]
    calls = [
        VerifyCall(p.session_id, p.cache_len, [cont[0]], d, [None] * len(d), post_id, post_q)
        for p, (_, d, post_id, post_q, _) in zip(pres, cases)
    ]
    outs = engine.run_batch(calls)
    assert [info.batch_size for _, info in outs] == [len(cases)] * len(cases)  # one forward pass
    for (out, _), (_, d, _, _, expected) in zip(outs, cases):
        assert isinstance(out, VerifyOutcome), out
        assert out.result == expected and out.cache_len == len(PROMPT) + 1 + len(d)
    for p in pres:
        engine.release(p.session_id)


def test_bad_post_tokens_are_invalid_argument(engine: TargetEngine) -> None:
    """A post token outside the vocabulary (greedy or sampled), or a sampled
    session's post q that fails the draft q checks, is INVALID_ARGUMENT
    naming the field; the session is untouched. A greedy session ignores q."""
    for cfg in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        pre = engine.prefill(PROMPT, cfg, True)
        assert pre.next_token is not None
        for bad_id in (engine.vocab_size, -1):
            with pytest.raises(InvalidArgument, match=rf"post_token_id {bad_id} is outside the vocabulary"):
                engine.verify(pre.session_id, pre.cache_len, [pre.next_token], [1], [None], bad_id)
        v = engine.verify(pre.session_id, pre.cache_len, [pre.next_token], [], [])
        assert v.cache_len == pre.cache_len + 1
        engine.release(pre.session_id)
    pre = engine.prefill(PROMPT, SamplingConfig(temperature=1.0), True)
    assert pre.next_token is not None
    f32 = np.float32
    bad_q = [  # (q for post token 2, message)
        ((np.array([3, 4]), np.array([0.5, 0.5], dtype=f32)), "post_prob: post token 2 has zero probability"),
        ((np.array([2, 3]), np.array([0.0, 1.0], dtype=f32)), "post_prob: post token 2 has zero probability"),
        ((np.array([2, 3]), np.array([0.5, 0.6], dtype=f32)), "post_prob: probabilities sum to"),
        ((np.array([2, 2]), np.array([0.5, 0.5], dtype=f32)), "post_prob: duplicate token ids"),
        ((np.array([2, 3]), np.array([np.nan, 1.0], dtype=f32)), "post_prob: probabilities must be finite"),
        ((np.array([2, 99]), np.array([0.5, 0.5], dtype=f32)), r"post_prob.token_ids contains token id 99, outside the vocabulary"),
        ((np.array([2]), np.array([0.5, 0.5], dtype=f32)), "post_prob: token_ids .* and of equal length"),
        ((np.array([], dtype=np.int64), np.array([1.0], dtype=f32)), "post_prob: token_ids .* must be non-empty"),
    ]
    for q, message in bad_q:
        with pytest.raises(InvalidArgument, match=message):
            engine.verify(pre.session_id, pre.cache_len, [pre.next_token], [1], [None], 2, q)
    good = (np.array([2, 3]), np.array([0.25, 0.75], dtype=f32))
    # the session is untouched, and a valid q works
    v = engine.verify(pre.session_id, pre.cache_len, [pre.next_token], [], [], 2, good)
    assert v.cache_len == pre.cache_len + 1 and v.result.num_accepted == 0
    engine.release(pre.session_id)
    pre = engine.prefill(PROMPT, SamplingConfig(), True)
    assert pre.next_token is not None
    v = engine.verify(pre.session_id, pre.cache_len, [pre.next_token], [], [], 2, bad_q[0][0])  # greedy: q not used
    assert v.cache_len == pre.cache_len + 1
    engine.release(pre.session_id)


@pytest.fixture(scope="module")
def target_stub(  # type: ignore[no-untyped-def]
    tiny_models, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[target_pb2_grpc.TargetStub]:
    from target_service.config import TargetServiceConfig
    from target_service.server import start

    loop = LoopThread()
    cfg = TargetServiceConfig(model=str(tiny_models.target), port=0, dtype="float32", backend="eager",
                              calibrate=False, cache_dir=Path(tmp_path_factory.mktemp("post-verify-cache")))
    server = loop.run(start(cfg))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield target_pb2_grpc.TargetStub(channel)
    finally:
        channel.close()
        loop.run(server.stop(0))
        loop.close()


def _prefill(stub: target_pb2_grpc.TargetStub, temperature: float = 0.0, top_k: int = 0) -> target_pb2.PrefillResponse:
    return stub.Prefill(target_pb2.PrefillRequest(
        token_ids=PROMPT, sample_next_token=True,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k)), timeout=60)


def test_grpc_verify_post_token_fields(target_stub: target_pb2_grpc.TargetStub) -> None:
    """Verify over gRPC: has_post_token / post_token_id / post_prob are read
    (empty post_prob = one-hot q), next_is_post is answered; without
    has_post_token the id is ignored; bad post tokens are INVALID_ARGUMENT."""
    stub = target_stub
    pre = _prefill(stub)
    probe = stub.Verify(target_pb2.VerifyRequest(
        session_id=pre.session_id, cache_len=pre.cache_len, new_token_ids=[pre.next_token_id]), timeout=60)
    argmax = probe.next_token_id  # the greedy token after PROMPT + t0
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=60)

    def verify(pre: target_pb2.PrefillResponse, **post: object) -> target_pb2.VerifyResponse:
        return stub.Verify(target_pb2.VerifyRequest(
            session_id=pre.session_id, cache_len=pre.cache_len, new_token_ids=[pre.next_token_id], **post), timeout=60)

    for temperature, top_k, post_prob in [
        (0.0, 0, None),  # greedy
        (1.0, 1, None),  # sampled (p one-hot on the argmax), one-hot q
        (1.0, 1, common_pb2.SparseDistribution(token_ids=[argmax, 0], probs=[0.5, 0.5])),  # sampled, sparse q
    ]:
        pre = _prefill(stub, temperature, top_k)
        extra = {} if post_prob is None else {"post_prob": post_prob}
        r = verify(pre, has_post_token=True, post_token_id=argmax, **extra)
        assert (r.num_accepted, r.next_token_id, r.next_is_post, r.next_is_bonus) == (0, argmax, True, False)
        assert r.cache_len == len(PROMPT) + 1
        stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=60)

    pre = _prefill(stub)
    r = verify(pre, has_post_token=False, post_token_id=argmax)  # not flagged: ignored
    assert (r.next_token_id, r.next_is_post, r.next_is_bonus) == (argmax, False, True)
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=60)

    pre = _prefill(stub, temperature=1.0)
    for post, match in [
        ({"post_token_id": 5000}, "post_token_id 5000 is outside the vocabulary"),
        ({"post_token_id": 2, "post_prob": common_pb2.SparseDistribution(token_ids=[3], probs=[1.0])},
         "post_prob: post token 2 has zero probability"),
        ({"post_token_id": 2, "post_prob": common_pb2.SparseDistribution(probs=[1.0])},
         "post_prob: token_ids .* must be non-empty"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            verify(pre, has_post_token=True, **post)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(match, e.value.details()), e.value.details()
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=60)


def _decode_on(stub: target_pb2_grpc.TargetStub, sid: str, cache_len: int, last: int, n: int) -> list[int]:
    """``n`` plain decoding steps (Verify without a drafted span) on a session."""
    out = []
    for _ in range(n):
        r = stub.Verify(target_pb2.VerifyRequest(session_id=sid, cache_len=cache_len, new_token_ids=[last]), timeout=60)
        last, cache_len = r.next_token_id, r.cache_len
        out.append(last)
    return out


def test_a_rebuilt_sampled_session_draws_the_stream_of_its_rng_offset(target_stub: target_pb2_grpc.TargetStub) -> None:
    """PrefillRequest.rng_offset over gRPC (docs/design.md rule 6): a sampled
    session rebuilt at committed length n continues reproducibly (the same
    tokens every time it is rebuilt at n), and on a stream of its own: not
    the seed's own stream, which the original session already drew from,
    not the stream of another offset, nor another seed's own stream (seed +
    offset collided: seed 11 rebuilt at n replayed seed 11 + n). A target
    that ignored rng_offset would replay the original session's draws."""
    stub = target_stub
    sampling = common_pb2.SamplingParams(temperature=2.0, seed=11)
    pre = stub.Prefill(target_pb2.PrefillRequest(token_ids=PROMPT, sampling=sampling, sample_next_token=True),
                       timeout=60)
    original = [pre.next_token_id] + _decode_on(stub, pre.session_id, pre.cache_len, pre.next_token_id, 23)
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=60)
    committed = PROMPT + original[:4]  # the session was lost after 4 generated tokens

    def rebuilt(offset: int, seed: int = 11) -> list[int]:
        r = stub.Prefill(target_pb2.PrefillRequest(token_ids=committed[:-1],
                                                   sampling=common_pb2.SamplingParams(temperature=2.0, seed=seed),
                                                   sample_next_token=False, rng_offset=offset), timeout=60)
        out = _decode_on(stub, r.session_id, r.cache_len, committed[-1], 20)
        stub.Release(common_pb2.ReleaseRequest(session_id=r.session_id), timeout=60)
        return out

    n = len(committed)
    at_n = rebuilt(n)
    assert rebuilt(n) == at_n  # reproducible
    assert at_n != rebuilt(0)  # not the seed's own stream
    assert at_n != rebuilt(n + 1)
    assert at_n != rebuilt(0, seed=11 + n)
    assert len(set(at_n)) > 3  # a sample, not a near-deterministic model
