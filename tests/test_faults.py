"""A faulty draft never ends a user's stream (docs/design.md §5), and a
recreated draft session draws fresh randomness (rule 6). Faults come from a
misbehaving proxy in front of the real services (tests/faults.py): real
servers on loopback, tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2
from tests.faults import FaultyProxy
from tests.stack import Stack, start_stack
from tests.test_e2e_tiny import exact_sequence_distribution
from tests.test_sampling import assert_matches


def faulty_stack(
    target: Path, draft: Path, cache: Path, setup: Any = None, draft_mode: str = "unary", **orchestrator: Any
) -> tuple[Stack, dict[str, FaultyProxy]]:
    """Real services behind fault proxies. ``draft_mode`` is the
    orchestrator's default: "unary" for the tests that rewrite Propose calls,
    "stream" / "run-ahead" for those that rewrite Session events."""
    proxies: dict[str, FaultyProxy] = {}

    async def interpose(t: str, d: str) -> tuple[str, str]:
        proxies["target"] = await FaultyProxy.start("specdec.v1.Target", t)
        proxies["draft"] = await FaultyProxy.start("specdec.v1.Draft", d)
        if setup is not None:
            setup(proxies)
        return proxies["target"].address, proxies["draft"].address

    overrides = {"draft_mode": draft_mode, **orchestrator}
    return start_stack(target, draft, cache, interpose=interpose, orchestrator_overrides=overrides), proxies


def close(stack: Stack, proxies: dict[str, FaultyProxy]) -> None:
    for p in proxies.values():
        stack.loop.run(p.stop())
    stack.close()


@pytest.fixture(scope="module")
def faulty(tiny_models, onnx_cache_dir: Path):  # type: ignore[no-untyped-def]
    st, proxies = faulty_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    yield st, proxies
    close(st, proxies)


def _clear(proxies: dict[str, FaultyProxy]) -> None:
    for p in proxies.values():
        p.on_request.clear()
        p.on_response.clear()
        p.on_event.clear()


@pytest.fixture
def clean(faulty):  # type: ignore[no-untyped-def]
    st, proxies = faulty
    _clear(proxies)
    yield st, proxies
    _clear(proxies)
    st.wait_no_sessions()


def _out_of_vocab(req: Any, resp: Any) -> Any:
    resp.token_ids[0] = 10_000  # the tiny vocabulary has 34 ids
    return resp


def _long_span(req: Any, resp: Any) -> Any:
    resp.token_ids.extend([1] * 40)  # more than asked for, and more than the target's max_span
    return resp


def _bad_q(req: Any, resp: Any) -> Any:
    for d in resp.probs:
        for i in range(len(d.probs)):
            d.probs[i] *= 0.5  # sums to 0.5: not a distribution
    return resp


def _wrong_position(req: Any, resp: Any) -> Any:
    resp.committed_len += 1  # tokens for another prefix
    return resp


@pytest.mark.parametrize("fault", [_out_of_vocab, _long_span, _wrong_position], ids=["ids", "span", "prefix"])
def test_a_draft_sending_garbage_falls_back_to_target_only(clean, fault) -> None:  # type: ignore[no-untyped-def]
    stack, proxies = clean
    prompt = "the quick brown fox"
    off = stack.generate(prompt=prompt, mode="off", max_new_tokens=24)
    proxies["draft"].on_response["Propose"] = fault
    spec = stack.generate(prompt=prompt, mode="fixed", gamma=4, max_new_tokens=24)
    assert spec["token_ids"] == off["token_ids"]
    assert spec["finish_reason"] == off["finish_reason"]
    assert spec["stats"].draft_failures >= 1
    assert spec["stats"].accepted_tokens == 0  # nothing the faulty draft sent was committed


def test_a_bad_q_is_a_draft_fault_and_the_seeded_output_is_target_only(clean) -> None:  # type: ignore[no-untyped-def]
    """Every drafted span carries a q that is not a distribution: the target
    refuses it (INVALID_ARGUMENT) before drawing any randomness, each round is
    redone with γ = 0, so the seeded output equals seeded target-only."""
    stack, proxies = clean
    kw = dict(prompt="sampled", temperature=1.0, seed=11, max_new_tokens=20)
    off = stack.generate(mode="off", **kw)
    proxies["draft"].on_response["Propose"] = _bad_q
    spec = stack.generate(mode="fixed", gamma=3, **kw)
    assert spec["token_ids"] == off["token_ids"]
    assert spec["stats"].draft_failures >= 1


def test_a_target_session_out_of_step_is_rebuilt(clean) -> None:  # type: ignore[no-untyped-def]
    stack, proxies = clean
    prompt = "out of step"
    off = stack.generate(prompt=prompt, mode="off", max_new_tokens=24)
    n = {"verify": 0}

    def skew(req: Any, context: Any) -> Any:
        n["verify"] += 1
        if n["verify"] == 3:
            req.cache_len += 1  # FAILED_PRECONDITION from the real target
        return req

    proxies["target"].on_request["Verify"] = proxies["target"].on_request["VerifyStream"] = skew
    spec = stack.generate(prompt=prompt, mode="fixed", gamma=3, max_new_tokens=24)
    assert spec["token_ids"] == off["token_ids"]
    assert spec["stats"].target_rebuilds == 1
    assert stack.target.engine.num_sessions == 0 or stack.wait_no_sessions() is None  # the stale session was released


def test_a_drafter_with_another_vocabulary_is_refused_by_name(tiny_models, onnx_cache_dir: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("ERROR", logger="specdec.orchestrator")

    def setup(proxies: dict[str, FaultyProxy]) -> None:
        """The draft replica lists one more drafter, "impostor", whose model
        info reports another tokenizer (it would propose foreign ids)."""
        impostor_calls: set[int] = set()

        def request(req: Any, context: Any) -> Any:
            if req.drafter == "impostor":
                req.drafter = ""  # the real service answers for its default
                impostor_calls.add(id(req))
            return req

        def response(req: Any, resp: Any) -> Any:
            if id(req) in impostor_calls:
                impostor_calls.discard(id(req))
                out = common_pb2.ModelInfo()
                out.CopyFrom(resp)
                out.drafter, out.tokenizer_fingerprint = "impostor", "0" * 64
                return out
            if "impostor" not in resp.drafters:
                resp.drafters.append("impostor")
            return resp

        proxies["draft"].on_request["GetModelInfo"] = request
        proxies["draft"].on_response["GetModelInfo"] = response

    stack, proxies = faulty_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, setup)
    try:
        assert "impostor" in stack.orchestrator.servicer.refused_drafters
        with pytest.raises(grpc.RpcError) as e:
            stack.generate(prompt="x", mode="fixed", gamma=2, drafter="impostor", max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "impostor" in (e.value.details() or "") and "refused" in (e.value.details() or "")
        ok = stack.generate(prompt="x", mode="fixed", gamma=2, max_new_tokens=8)  # the default drafter still speculates
        assert ok["stats"].draft_tokens > 0
        assert any("drafter refused" in r.getMessage() and getattr(r, "fields", {}).get("drafter") == "impostor"
                   for r in caplog.records)
    finally:
        close(stack, proxies)


# ------------------------------------------------------- draft stream faults
# Over a Session stream (run-ahead on), a faulty draft never ends the user's
# stream either: each case finishes with the target-only output.
STALL_S = 0.5  # the orchestrator's draft_timeout_s in these tests: a stalled stream is given up after it


@pytest.fixture(scope="module")
def stream_faulty(tiny_models, onnx_cache_dir: Path):  # type: ignore[no-untyped-def]
    st, proxies = faulty_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, draft_mode="run-ahead",
                               draft_timeout_s=STALL_S, draft_retry_after_rounds=2)
    yield st, proxies
    close(st, proxies)


@pytest.fixture
def stream_clean(stream_faulty):  # type: ignore[no-untyped-def]
    st, proxies = stream_faulty
    _clear(proxies)
    yield st, proxies
    _clear(proxies)
    st.wait_no_sessions()


def _token_fault(edit: Any) -> Any:
    """A Session event hook that applies ``edit`` to each drafted token from
    the second on (so the stream opens and drafts normally at first), whether
    the draft sends them one per event or in batches. ``edit`` changes a
    ``DraftedToken`` in place; None drops the whole event."""
    seen = {"n": 0}

    def hook(event: Any) -> Any:
        kind = event.WhichOneof("kind")
        tokens = [event.token] if kind == "token" else list(event.batch.tokens) if kind == "batch" else []
        for t in tokens:
            seen["n"] += 1
            if seen["n"] >= 2 and edit(t) is None:
                return None
        return event

    return hook


def _ev_out_of_vocab(t: Any) -> Any:
    t.token_id = 10_000
    return t


def _ev_bad_q(t: Any) -> Any:
    for i in range(len(t.prob.probs)):
        t.prob.probs[i] *= 0.5  # sums to 0.5: not a distribution
    return t


def _ev_wrong_position(t: Any) -> Any:
    t.position += 3
    return t


def _ev_unknown_version(t: Any) -> Any:
    t.version += 100  # a prefix version the orchestrator never committed
    return t


def _ev_old_version(t: Any) -> Any:
    t.version = 0  # every token claims the open's prefix, whatever it was drafted on
    return t


def _ev_stall(t: Any) -> None:
    return None  # the stream stays open but sends nothing more


@pytest.mark.parametrize(
    "edit", [_ev_out_of_vocab, _ev_bad_q, _ev_wrong_position, _ev_unknown_version, _ev_old_version, _ev_stall],
    ids=["ids", "q", "position", "unknown-version", "old-version", "stall"],
)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_faulty_draft_stream_never_changes_the_output(stream_clean, edit, sampled) -> None:  # type: ignore[no-untyped-def]
    """Garbage on the stream (ids outside the vocabulary, a q that is not a
    distribution, wrong positions, unknown or stale prefix versions) and a
    stream that stalls: the request finishes with the target-only output
    (greedy: the same tokens; seeded: the faulty spans are refused or never
    verified, so the same seeded target-only draws) and counts the fallback."""
    stack, proxies = stream_clean
    kw: dict[str, Any] = dict(prompt="the quick brown fox", max_new_tokens=24)
    if sampled:
        kw.update(temperature=1.0, seed=5)
    off = stack.generate(mode="off", **kw)
    proxies["draft"].on_event["Session"] = _token_fault(edit)
    spec = stack.generate(mode="fixed", gamma=3, **kw)
    if not sampled or edit in (_ev_bad_q, _ev_out_of_vocab, _ev_stall, _ev_wrong_position, _ev_unknown_version):
        assert spec["token_ids"] == off["token_ids"]
    assert spec["finish_reason"] == off["finish_reason"]
    if sampled or edit is not _ev_bad_q:  # greedy verification never reads q
        assert spec["stats"].draft_failures >= 1
    assert spec["stats"].draft_mode == "run-ahead"


def test_a_stalled_stream_costs_the_timeout_not_the_request(stream_clean) -> None:  # type: ignore[no-untyped-def]
    """A draft that stops sending mid-request: each stall is given up after
    draft_timeout_s and the request goes on target-only, then reopens a
    stream (which stalls again here) after draft_retry_after_rounds."""
    stack, proxies = stream_clean
    proxies["draft"].on_event["Session"] = _token_fault(_ev_stall)
    spec = stack.generate(prompt="stall", mode="fixed", gamma=3, max_new_tokens=12)
    s = spec["stats"]
    assert len(spec["token_ids"]) == 12 and s.draft_failures >= 1
    assert s.total_ms < (s.draft_failures + 1) * STALL_S * 1e3 + 10_000


# ------------------------------------------------- recreated draft sessions
# Power of the marginal test below (N = 1500 requests, 36 outcomes of
# (t1, t3), chi-square at p < 1e-4 after merging bins with expected < 5): a
# shift of 0.026 of probability mass between two outcomes of probability
# 1/36 is detected with probability 0.99 (noncentral chi-square: λ = N · 2Δ²
# / p = 75, what 99 % power needs at 26 degrees of freedom). Both negative
# controls (the old behaviour, a recreated session restarting its seed's
# stream; a draft reporting a q it did not sample from) must fail it.
RECREATE_N = 1500
# A replayed stream re-draws the same quantile: d2 = F_q2⁻¹(u1) where the
# committed t1 already reveals u1. The bias is largest where q is flat and
# alike from round to round, so these tests sample at temperature 4 (an
# in-process Monte Carlo of the protocol on these models: total variation
# between fresh and replayed streams 0.13 at temperature 4, 0.004 at 1).
REPLAY_TEMPERATURE = 4.0


def _drop_every_session(proxies: dict[str, FaultyProxy], replay_seed_stream: bool) -> None:
    """After every Propose, the draft session is released behind the
    orchestrator's back (an eviction): the next round finds it gone and
    recreates it. ``replay_seed_stream`` emulates the old orchestrator, which
    recreated it on the seed's first stream again."""
    from specdec.v1 import draft_pb2, draft_pb2_grpc

    draft = proxies["draft"]
    stub = draft_pb2_grpc.DraftStub(draft.upstream)

    async def evict(request: Any, response: Any) -> Any:
        await stub.Release(common_pb2.ReleaseRequest(session_id=request.session_id), timeout=5)
        return response

    draft.on_response["Propose"] = evict
    if replay_seed_stream:
        def replay(request: draft_pb2.CreateDraftSessionRequest, context: Any) -> Any:
            request.rng_offset = 0
            return request
        draft.on_request["CreateSession"] = replay


def _marginal_t1_t3(small_stack: Stack, small_target: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompt, length, cfg = [1, 2, 3], 5, SamplingConfig(temperature=REPLAY_TEMPERATURE)
    exact = exact_sequence_distribution(small_target, prompt, length, cfg)
    vocab = int(round(len(exact) ** (1 / length)))
    marg = np.zeros((vocab, vocab))
    for seq, p in exact.items():
        marg[seq[1], seq[3]] += p
    counts = np.zeros((vocab, vocab))
    stub = small_stack.orch_stub()
    rounds_with_new_sessions = 0
    for seed in range(n):
        r = small_stack.generate(stub, prompt_token_ids=prompt, max_new_tokens=length, temperature=cfg.temperature, seed=seed,
                                 mode="fixed", gamma=1)
        ids = r["token_ids"]
        counts[ids[1], ids[3]] += 1
        rounds_with_new_sessions += r["stats"].draft_tokens
    assert rounds_with_new_sessions >= n  # every request drafted (in sessions recreated each round)
    return counts.ravel(), marg.ravel()


@pytest.fixture(scope="module")
def small_faulty(tiny_models, onnx_cache_dir: Path):  # type: ignore[no-untyped-def]
    # unary: the faults below rewrite Propose and CreateSession calls
    st, proxies = faulty_stack(tiny_models.small_target, tiny_models.small_draft, onnx_cache_dir)
    yield st, proxies, tiny_models.small_target
    close(st, proxies)


def _sample_marginal(small_faulty: Any, fault: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Installs ``fault(proxies)``, samples the (t1, t3) marginal, removes the
    fault; returns counts, exact probabilities and draft sessions created."""
    stack, proxies, target = small_faulty
    fault(proxies)
    try:
        created_before = proxies["draft"].calls.get("CreateSession", 0)
        counts, expected = _marginal_t1_t3(stack, target, RECREATE_N)
        return counts, expected, proxies["draft"].calls.get("CreateSession", 0) - created_before
    finally:
        _clear(proxies)
        stack.wait_no_sessions()


@pytest.mark.statistical
def test_recreated_draft_sessions_keep_the_exact_distribution(small_faulty) -> None:  # type: ignore[no-untyped-def]
    counts, expected, created = _sample_marginal(small_faulty, lambda p: _drop_every_session(p, False))
    assert created >= 2 * RECREATE_N  # at least two draft sessions a request
    assert_matches(counts, expected)


@pytest.mark.statistical
def test_negative_control_replaying_the_seed_stream_is_detected(small_faulty) -> None:  # type: ignore[no-untyped-def]
    counts, expected, _ = _sample_marginal(small_faulty, lambda p: _drop_every_session(p, True))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_matches(counts, expected)


@pytest.mark.statistical
def test_negative_control_a_draft_lying_about_q_is_detected(small_faulty) -> None:  # type: ignore[no-untyped-def]
    """The whole pipeline's distribution test catches a draft that reports a
    q other than the one it sampled from (here: uniform over the same
    support): the target accepts the lie, so the output is biased."""
    def lie(request: Any, response: Any) -> Any:
        for d in response.probs:
            k = len(d.probs)
            for i in range(k):
                d.probs[i] = 1.0 / k
        return response

    counts, expected, _ = _sample_marginal(small_faulty, lambda p: p["draft"].on_response.__setitem__("Propose", lie))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_matches(counts, expected)
