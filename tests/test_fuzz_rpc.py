"""Property-based fuzzing (hypothesis) of every RPC against the three live
services on tiny models: arbitrary field values -- ids, lengths, floats
including NaN and infinities, random session ids, random q vectors -- and
arbitrary bytes on the wire.

Properties, for every example: the status is never UNKNOWN or INTERNAL;
every server stays SERVING; the sessions the example created are the only
ones left (and are released); after the run a valid request still returns
the reference output.

Bounded for CI: ``SPECDEC_FUZZ_EXAMPLES`` examples per test (default 60,
about 25 s for the module on 2 CPU cores) with a fixed seed. A longer,
randomised run::

    SPECDEC_FUZZ_EXAMPLES=2000 SPECDEC_FUZZ_RANDOM=1 PYTHONPATH=$PWD \\
        python -m pytest -q tests/test_fuzz_rpc.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2 as pb, target_pb2
from tests.stack import Stack, make_request, start_stack

VOCAB = 34
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                    orchestrator_overrides={"max_new_tokens_limit": 24, "default_max_new_tokens": 6})
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[int]:
    return stack.generate(prompt="reference", mode="off", max_new_tokens=12)["token_ids"]


def fuzz(test: Callable[..., None]) -> Callable[..., None]:
    """Applies the run's settings (read when the test runs, not at import)."""
    examples = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "60"))
    return settings(
        max_examples=examples,
        deadline=None,  # RPC latency on a shared CPU is not the property under test
        derandomize=not os.environ.get("SPECDEC_FUZZ_RANDOM"),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(test)


# ----------------------------------------------------------------- values
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
probability = st.one_of(st.floats(0, 1, width=32), f32)
int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
token = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), int32)
tokens = st.one_of(st.lists(token, max_size=40), st.integers(0, 700).map(lambda n: [1] * n))
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # protobuf cannot send lone surrogates


@st.composite
def sampling(draw: Any) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.sampled_from([0.0, 0.7, 1.0]), f32)),
        top_p=draw(st.one_of(st.sampled_from([0.0, 0.9, 1.0]), f32)),
        top_k=draw(st.one_of(st.integers(0, VOCAB + 2), int32)),
    )
    seed = draw(st.none() | st.integers(0, 2**64 - 1))
    if seed is not None:
        msg.seed = seed
    return msg


sparse_q = st.builds(
    lambda ids, probs: common_pb2.SparseDistribution(token_ids=ids, probs=probs),
    st.lists(token, max_size=6),
    st.lists(probability, max_size=6),
)


def status(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{e.code().name}: {e.details()}"
        return e.code()
    return grpc.StatusCode.OK


class Sessions:
    """Sessions an example created on purpose; released at its end."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.t = stack.target_stub()
        self.d = stack.draft_stub()
        self.target: list[str] = []
        self.draft: list[str] = []

    def close(self, immediate: bool = True) -> None:
        """``immediate``: the call under test released what it made before
        answering (the model services do; the orchestrator releases its
        sessions as the stream ends, which ``assert_clean`` waits for)."""
        if immediate:
            assert self.stack.target_sessions() == len(set(self.target)), "a failed call left a target session"
            assert self.stack.draft_sessions() == len(set(self.draft)), "a failed call left a draft session"
        for sid in self.target:
            self.t.Release(common_pb2.ReleaseRequest(session_id=sid))
        for sid in self.draft:
            self.d.Release(common_pb2.ReleaseRequest(session_id=sid))
        self.stack.assert_clean()


# ------------------------------------------------------------------ tests
def test_fuzz_target_prefill_and_verify(stack: Stack, reference: list[int]) -> None:
    @fuzz
    @given(
        prefill_ids=tokens, prefill_sampling=sampling(), sample_next=st.booleans(), rng_offset=st.integers(0, 2**64 - 1),
        sid=st.one_of(st.just("<valid>"), st.just("<valid>"), text), cache_len=st.one_of(st.just(-1), uint32),
        new_ids=tokens, draft_ids=st.lists(token, max_size=40), q=st.lists(sparse_q, max_size=6),
        one_hot_q=st.booleans(),
    )
    def run(prefill_ids: list[int], prefill_sampling: Any, sample_next: bool, rng_offset: int, sid: str,
            cache_len: int, new_ids: list[int], draft_ids: list[int], q: list[Any], one_hot_q: bool) -> None:
        s = Sessions(stack)
        pre: list[Any] = []

        def prefill() -> None:
            pre.append(s.t.Prefill(target_pb2.PrefillRequest(
                token_ids=prefill_ids, sampling=prefill_sampling, sample_next_token=sample_next,
                rng_offset=rng_offset), timeout=30))
            s.target.append(pre[0].session_id)

        status(prefill)
        valid_sid = pre[0].session_id if pre else ""
        draft_q = [] if one_hot_q else (q or [common_pb2.SparseDistribution(token_ids=[t], probs=[1.0])
                                              for t in draft_ids])
        status(lambda: s.t.Verify(target_pb2.VerifyRequest(
            session_id=valid_sid if sid == "<valid>" else sid,
            cache_len=pre[0].cache_len if (pre and cache_len == -1) else max(cache_len, 0),
            new_token_ids=new_ids, draft_token_ids=draft_ids, draft_probs=draft_q), timeout=30))
        s.close()

    run()
    assert stack.generate(prompt="reference", mode="off", max_new_tokens=12)["token_ids"] == reference


def test_fuzz_draft_create_and_propose(stack: Stack, reference: list[int]) -> None:
    @fuzz
    @given(
        create_sampling=st.none() | sampling(), drafter=st.one_of(st.just(""), text),
        sid=st.one_of(st.just("<valid>"), st.just("<valid>"), text),
        rounds=st.lists(st.tuples(uint32, tokens, st.one_of(st.integers(0, 20), uint32), probability), max_size=3),
        release_first=st.booleans(),
    )
    def run(create_sampling: Any, drafter: str, sid: str, rounds: list[Any], release_first: bool) -> None:
        s = Sessions(stack)
        made: list[str] = []

        def create() -> None:
            req = draft_pb2.CreateDraftSessionRequest(drafter=drafter)
            if create_sampling is not None:
                req.sampling.CopyFrom(create_sampling)
            made.append(s.d.CreateSession(req, timeout=30).session_id)
            s.draft.append(made[0])

        status(create)
        target = made[0] if (made and sid == "<valid>") else sid
        if release_first and made:
            status(lambda: s.d.Release(common_pb2.ReleaseRequest(session_id=made[0])))
            s.draft.remove(made[0])
        for base_len, new_ids, num_tokens, min_conf in rounds:
            status(lambda: s.d.Propose(draft_pb2.ProposeRequest(
                session_id=target, base_len=base_len, new_token_ids=new_ids, num_tokens=num_tokens,
                min_confidence=min_conf), timeout=30))
        s.close()

    run()
    assert stack.generate(prompt="reference", mode="fixed", gamma=4, max_new_tokens=12)["token_ids"] == reference


@st.composite
def generate_requests(draw: Any) -> pb.GenerateRequest:
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none", "two"]))
    req = make_request(
        prompt=draw(text) if kind in ("prompt", "two") else "",
        prompt_token_ids=draw(tokens) if kind in ("ids", "two") else None,
        messages=draw(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", ""]) | text, text),
                               max_size=3)) if kind == "messages" else None,
        max_new_tokens=draw(st.one_of(st.integers(0, 30), uint32)),
        stop=draw(st.lists(text, max_size=3)),
        ignore_eos=draw(st.booleans()),
    )
    req.sampling.CopyFrom(draw(sampling()))
    req.speculation.mode = draw(st.one_of(st.integers(0, 4), st.integers(0, 2**31 - 1)))
    req.speculation.num_draft_tokens = draw(st.one_of(st.integers(0, 20), uint32))
    req.speculation.drafter = draw(st.one_of(st.just(""), st.just(""), text))
    req.speculation.min_confidence = draw(probability)
    req.return_logit_gaps = draw(st.booleans())
    return req


def test_fuzz_generate(stack: Stack, reference: list[int]) -> None:
    @fuzz
    @given(req=generate_requests())
    def run(req: pb.GenerateRequest) -> None:
        s = Sessions(stack)
        status(lambda: list(s.stack.orch_stub().Generate(req, timeout=60)))
        s.close(immediate=False)

    run()
    assert stack.generate(prompt="reference", mode="auto", max_new_tokens=12)["token_ids"] == reference


METHODS = [
    ("Orchestrator", "Generate", True), ("Target", "GetModelInfo", False), ("Target", "Prefill", False),
    ("Target", "Verify", False), ("Target", "Release", False), ("Draft", "GetModelInfo", False),
    ("Draft", "CreateSession", False), ("Draft", "Propose", False), ("Draft", "Release", False),
]


def test_fuzz_raw_bytes_on_every_method(stack: Stack, reference: list[int]) -> None:
    ports = {"Orchestrator": stack.orchestrator.port, "Target": stack.target.port, "Draft": stack.draft.port}

    @fuzz
    @given(method=st.sampled_from(METHODS), payload=st.binary(max_size=200))
    def run(method: tuple[str, str, bool], payload: bytes) -> None:
        service, name, streaming = method
        s = Sessions(stack)
        ch = stack.channel(f"127.0.0.1:{ports[service]}")
        path = f"/specdec.v1.{service}/{name}"
        made: list[Any] = []

        def call() -> None:
            if streaming:
                made.extend(ch.unary_stream(path)(payload, timeout=60))
            else:
                made.append(ch.unary_unary(path)(payload, timeout=30))

        if status(call) == grpc.StatusCode.OK and name in ("Prefill", "CreateSession"):
            resp = (target_pb2.PrefillResponse if name == "Prefill" else draft_pb2.CreateDraftSessionResponse)
            sid = resp.FromString(made[0]).session_id
            (s.target if name == "Prefill" else s.draft).append(sid)
        s.close(immediate=service != "Orchestrator")

    run()
    assert stack.generate(prompt="reference", mode="off", max_new_tokens=12)["token_ids"] == reference
