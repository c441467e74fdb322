"""Decode-ahead (VerifyRequest.decode_ahead, orchestrator ``decode_ahead``):
without a drafter, the target runs the next plain steps on its own and
streams their replies, so a token's round trip overlaps the next step. It
must give exactly the replies the caller's own requests would have got
(greedy and seeded sampling: the same tokens), stop after a stop token,
and leave nothing behind when the caller stops reading. Real services on
loopback, tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from specdec.v1 import common_pb2, target_pb2
from tests.stack import Stack, start_stack


def _stack(tiny_models: Any, onnx_cache_dir: Path, ahead: int) -> Iterator[Stack]:
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                    orchestrator_overrides={"decode_ahead": ahead, "target_verify_stream": True})
    yield s
    s.close()


@pytest.fixture(scope="module")
def ahead(tiny_models, onnx_cache_dir: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    yield from _stack(tiny_models, onnx_cache_dir, 16)


@pytest.fixture(scope="module")
def plain(tiny_models, onnx_cache_dir: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    yield from _stack(tiny_models, onnx_cache_dir, 0)


def _prefill(stack: Stack, ids: list[int], seed: int | None = None, top_k: int = 8) -> target_pb2.PrefillResponse:
    sampling = common_pb2.SamplingParams(temperature=1.0, top_k=top_k, seed=seed) if seed is not None \
        else common_pb2.SamplingParams()
    return stack.target_stub().Prefill(target_pb2.PrefillRequest(token_ids=ids, sampling=sampling,
                                                                 sample_next_token=True), timeout=30)


def _stepwise(stack: Stack, ids: list[int], steps: int, seed: int | None = None) -> list[tuple[int, int]]:
    """(next token, cache_len) of the prefill and then `steps` plain Verify calls."""
    pre = _prefill(stack, ids, seed)
    out = [(pre.next_token_id, pre.cache_len)]
    stub = stack.target_stub()
    for _ in range(steps):
        r = stub.Verify(target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=out[-1][1],
                                                 new_token_ids=[out[-1][0]]), timeout=30)
        out.append((r.next_token_id, r.cache_len))
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=10)
    return out


def _ahead(stack: Stack, ids: list[int], steps: int, seed: int | None = None,
           stops: tuple[int, ...] = ()) -> tuple[list[tuple[int, int]], list[int]]:
    """The same through one VerifyStream request with decode_ahead = steps - 1:
    ((next token, cache_len) per reply, ahead_left per reply)."""
    pre = _prefill(stack, ids, seed)
    req = target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=pre.cache_len,
                                   new_token_ids=[pre.next_token_id], decode_ahead=steps - 1, stop_token_ids=stops)
    out, left = [(pre.next_token_id, pre.cache_len)], []
    call = stack.target_stub().VerifyStream(iter([req]), timeout=30)
    for r in call:
        out.append((r.next_token_id, r.cache_len))
        left.append(r.ahead_left)
    stack.target_stub().Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=10)
    return out, left


@pytest.mark.parametrize("seed", [None, 11])
def test_a_decode_ahead_run_answers_what_the_callers_own_requests_would(ahead: Stack, seed: int | None) -> None:
    """One request with decode_ahead 5 gets six replies: the tokens and cache
    lengths of six plain Verify calls, greedy and seeded sampling alike (the
    same draws from the session's generator); ahead_left counts down to 0.
    Negative control: a different seed gives other sampled tokens."""
    ids = [3, 5, 7, 9, 11]
    ref = _stepwise(ahead, ids, 6, seed)
    got, left = _ahead(ahead, ids, 6, seed)
    assert got == ref
    assert left == [5, 4, 3, 2, 1, 0]
    if seed is not None:
        other, _ = _ahead(ahead, ids, 6, seed + 1)
        assert [t for t, _ in other] != [t for t, _ in got]
    ahead.wait_no_sessions()


def test_a_stop_token_ends_the_run(ahead: Stack) -> None:
    """The run ends with the reply whose token is a stop token (ahead_left 0),
    however many steps were asked for."""
    ids = [3, 5, 7, 9, 11]
    ref = _stepwise(ahead, ids, 8)
    stop = ref[3][0]
    first = next(i for i in range(1, len(ref)) if ref[i][0] == stop)  # replies start at ref[1]
    got, left = _ahead(ahead, ids, 8, stops=(stop,))
    assert got == ref[: first + 1] and left[-1] == 0 and len(left) == first
    ahead.wait_no_sessions()


def test_drafted_spans_and_unary_verify_never_run_ahead(ahead: Stack) -> None:
    """decode_ahead applies to plain rounds on the stream only: with a drafted
    span the request gets its one reply; unary Verify ignores the field."""
    pre = _prefill(ahead, [3, 5, 7])
    stub = ahead.target_stub()
    req = target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=pre.cache_len,
                                   new_token_ids=[pre.next_token_id], draft_token_ids=[4, 4], decode_ahead=8)
    replies = list(stub.VerifyStream(iter([req]), timeout=30))
    assert len(replies) == 1 and replies[0].ahead_left == 0
    r = stub.Verify(target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=replies[0].cache_len,
                                             new_token_ids=[replies[0].next_token_id], decode_ahead=8), timeout=30)
    assert r.ahead_left == 0 and r.cache_len == replies[0].cache_len + 1
    stub.Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=10)
    ahead.wait_no_sessions()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 6, "seed": 5}])
def test_off_through_the_orchestrator_gives_the_same_tokens_with_and_without_it(
    ahead: Stack, plain: Stack, sampling: dict[str, Any]
) -> None:
    """OFF requests with decode-ahead on (16) and off (0): the same tokens,
    greedy and seeded sampling, for short and long requests (ahead bounded by
    max_new_tokens), and the run really happened on the first stack only."""
    before = (ahead.target.servicer.ahead_steps, plain.target.servicer.ahead_steps)  # type: ignore[union-attr]
    for prompt, n in (("hello world", 40), ("the quick brown fox", 3), ("a, b, c.", 1)):
        a = ahead.generate(prompt=prompt, mode="off", max_new_tokens=n, **sampling)
        b = plain.generate(prompt=prompt, mode="off", max_new_tokens=n, **sampling)
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == n, prompt
        assert a["stats"].rounds == b["stats"].rounds
    assert ahead.target.servicer.ahead_steps - before[0] > 30  # type: ignore[union-attr]
    if not sampling:  # AUTO decodes its committed plain rounds ahead (timing decides how many): the same tokens
        for prompt in ("hello world", "the quick brown fox"):
            a = ahead.generate(prompt=prompt, mode="auto", gamma=0, max_new_tokens=48)
            assert a["token_ids"] == plain.generate(prompt=prompt, mode="off", max_new_tokens=48)["token_ids"]
    assert plain.target.servicer.ahead_steps == before[1]  # type: ignore[union-attr]
    ahead.assert_clean()
    plain.assert_clean()


def test_stop_strings_eos_and_cancel_end_a_run_cleanly(ahead: Stack, plain: Stack) -> None:
    """A stop string or EOS in the middle of a run ends the request exactly
    where it ends without decode-ahead; a client that cancels mid-stream
    leaves no session and no stream behind, and the replica stays healthy."""
    ref = plain.generate(prompt="hello world", mode="off", max_new_tokens=30)
    stop = ref["text"][len(ref["text"]) // 2:][:3]
    if stop.strip():
        a = ahead.generate(prompt="hello world", mode="off", max_new_tokens=30, stop=[stop])
        b = plain.generate(prompt="hello world", mode="off", max_new_tokens=30, stop=[stop])
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
    eos = ahead.generate(prompt="hello world", mode="off", max_new_tokens=30, ignore_eos=False)
    assert eos["token_ids"] == plain.generate(prompt="hello world", mode="off", max_new_tokens=30,
                                              ignore_eos=False)["token_ids"]
    from tests.stack import make_request

    call = ahead.orch_stub().Generate(make_request(prompt="hello world", mode="off", max_new_tokens=60), timeout=60)
    next(iter(call))
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    ahead.assert_clean()
    assert ahead.health(ahead.target.port) == 1  # SERVING
    assert ahead.generate(prompt="hello world", mode="off", max_new_tokens=30)["token_ids"] == ref["token_ids"]


# ------------------------------------------- prompt lookup inside the run
def _lookup_run(stack: Stack, ids: list[int], budget: int, lookup: int, seed: int | None = None,
                stops: tuple[int, ...] = (), top_k: int = 8) -> tuple[list[int], list[target_pb2.VerifyResponse]]:
    """The tokens of a prefill and one VerifyStream request with decode_ahead
    = budget and ahead_lookup_tokens = lookup, and the replies."""
    pre = _prefill(stack, ids, seed, top_k)
    req = target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=pre.cache_len,
                                   new_token_ids=[pre.next_token_id], decode_ahead=budget,
                                   ahead_lookup_tokens=lookup, stop_token_ids=stops)
    replies = list(stack.target_stub().VerifyStream(iter([req]), timeout=30))
    stack.target_stub().Release(common_pb2.ReleaseRequest(session_id=pre.session_id), timeout=10)
    tokens = [pre.next_token_id]
    for r in replies:
        tokens += [*r.self_drafted_token_ids[: r.num_accepted], r.next_token_id]
    return tokens, replies


#: a prompt whose greedy continuation under the tiny target falls into a
#: loop the lookup can match (checked by the test: spans are verified)
LOOP_PROMPT = [3, 5, 7, 9, 11, 3, 5, 7, 9, 11, 3, 5, 7]


def test_lookup_in_a_run_gives_the_plain_greedy_tokens(ahead: Stack) -> None:
    """A run with ahead_lookup_tokens verifies the target's own prompt-lookup
    spans (some steps commit several tokens) and commits exactly the tokens
    of plain greedy steps, never more than decode_ahead of them; the cache
    lengths follow the tokens. Negative control: the run without lookup
    verifies no span."""
    budget = 40
    ref = [t for t, _ in _stepwise(ahead, LOOP_PROMPT, budget + 1)]  # the request's own reply, then the run's
    before = ahead.target.servicer.self_drafted_tokens  # type: ignore[union-attr]
    got, replies = _lookup_run(ahead, LOOP_PROMPT, budget, 4)
    assert got == ref and len(got) == budget + 2
    assert any(r.num_accepted > 0 for r in replies)  # steps that committed more than one token
    assert all(len(r.self_drafted_token_ids) <= 4 for r in replies)
    assert replies[-1].cache_len == len(LOOP_PROMPT) + budget + 1 and replies[-1].ahead_left == 0
    assert ahead.target.servicer.self_drafted_tokens > before  # type: ignore[union-attr]
    plain, plain_replies = _lookup_run(ahead, LOOP_PROMPT, budget, 0)
    assert plain == got and all(not r.self_drafted_token_ids for r in plain_replies)
    assert len(plain_replies) == budget + 1 > len(replies)  # the request's reply and one per plain step
    ahead.wait_no_sessions()


def test_a_stop_token_inside_a_verified_span_ends_the_run(ahead: Stack) -> None:
    """A stop token among a step's accepted span tokens ends the run with
    that step (ahead_left 0), as a stop token ends a plain run."""
    budget = 40
    got, replies = _lookup_run(ahead, LOOP_PROMPT, budget, 4)
    spans = [r for r in replies if r.num_accepted > 0]
    assert spans
    stop = spans[0].self_drafted_token_ids[0]
    first = next(i for i, t in enumerate(got) if t == stop and i > 0)
    cut, cut_replies = _lookup_run(ahead, LOOP_PROMPT, budget, 4, stops=(stop,))
    assert cut_replies[-1].ahead_left == 0 and stop in cut[1:]
    assert cut == got[: len(cut)] and len(cut) <= first + 5  # ends with the step that committed it
    ahead.wait_no_sessions()


@pytest.fixture(scope="module")
def small_ahead(tiny_models, onnx_cache_dir: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    """A target of 6 tokens: almost every bigram recurs, so lookup proposes
    often and is both accepted and rejected."""
    s = start_stack(tiny_models.small_target, tiny_models.small_draft, onnx_cache_dir,
                    orchestrator_overrides={"target_verify_stream": True})
    yield s
    s.close()


@pytest.mark.statistical
def test_lookup_in_a_run_samples_the_targets_distribution(small_ahead: Stack, tiny_models: Any) -> None:
    """Temperature 1, 400 requests of 50 tokens (a prefill's token, the
    request's own, then a run of 48 with ahead_lookup_tokens 3): every token
    follows the target's exact conditional distribution at its position
    (randomized PIT in 20 bins, chi-square at p < 1e-4, tests/test_e2e_tiny.py
    ``pit_counts``). Power: a shift of 0.0093 of mass between two PIT bins is
    detected with probability 0.99. The runs verified one-hot spans with both
    acceptances and rejections. Negative control: the same tokens scored at
    a 25 % higher temperature must fail."""
    from specdec.sampling import SamplingConfig
    from tests.test_e2e_tiny import PIT_BINS, control_config, pit_counts
    from tests.test_sampling import assert_detects, assert_matches

    cfg, prompt, budget = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2, 4, 1, 2], 48
    seqs, drafted, accepted = [], 0, 0
    for seed in range(400):
        tokens, replies = _lookup_run(small_ahead, prompt, budget, 3, seed=seed, top_k=0)
        assert len(tokens) == budget + 2
        seqs.append(tokens)
        drafted += sum(len(r.self_drafted_token_ids) for r in replies)
        accepted += sum(r.num_accepted for r in replies)
    assert 0 < accepted < drafted
    uniform = np.full(PIT_BINS, 1 / PIT_BINS)
    assert_matches(pit_counts(tiny_models.small_target, prompt, seqs, cfg), uniform)
    assert_detects(pit_counts(tiny_models.small_target, prompt, seqs, control_config(cfg)), uniform)
    small_ahead.wait_no_sessions()
