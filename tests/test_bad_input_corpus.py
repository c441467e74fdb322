"""A corpus of bad inputs against the three live services (tiny models, one
stack for the module). Every case asserts its exact gRPC status, that every
server is still SERVING afterwards, that the failed call left no session in
the target or draft service and no stream in the orchestrator.

A deadline "already expired" is a negative timeout (a deadline in the past):
grpc python sometimes still completes a fast call sent with timeout=0.

Release semantics (both model services): releasing an unknown, released or
reaped session is idempotent -- OK with ``released=false`` -- because the
services' state is a cache the orchestrator may have lost track of; an empty
session id is INVALID_ARGUMENT.

Requests that do not parse (invalid UTF-8 in a string field, garbage bytes)
are sent as hand-serialized bytes and get INVALID_ARGUMENT (grpc alone
would answer UNKNOWN); messages over the size limit get RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest

from specdec.v1 import common_pb2, draft_pb2, target_pb2
from tests.stack import Stack, free_port, make_request, scrape_metrics, start_stack

VOCAB = 34  # tests/conftest.py TINY_CHARS + 1
CONTEXT = 512  # tests.tiny max_position_embeddings
TARGET_SPAN = 32  # TargetServiceConfig.max_span
DRAFT_SPAN = 16  # DraftServiceConfig.max_span
OVERSIZE = 9 * 1024 * 1024  # over the 8 MiB default message limit
MAX_PROMPT_CHARS = 10_000
MAX_STREAMS_PER_CLIENT = 3

S = grpc.StatusCode
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(
        tiny_models.target, tiny_models.draft, onnx_cache_dir, target_overrides={"metrics_port": free_port()},
        orchestrator_overrides={"max_prompt_chars": MAX_PROMPT_CHARS,
                                "max_streams_per_client": MAX_STREAMS_PER_CLIENT},
    )
    yield s
    s.close()


# ------------------------------------------------------------ wire helpers
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def ld(field_no: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (string, bytes, message, packed)."""
    return varint(field_no << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = b"ab\xff\xfecd"
GARBAGE = b"\xff\xff\xff\xff\xff"


@dataclass
class Ctx:
    """What a case can use; sessions it creates on purpose are released (and
    counted) by the runner."""

    stack: Stack
    target_sids: list[str] = field(default_factory=list)
    draft_sids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.t = self.stack.target_stub()
        self.d = self.stack.draft_stub()

    def raw(self, service: str, method: str, payload: bytes, timeout: float = 30) -> Any:
        port = {"Orchestrator": self.stack.orchestrator.port, "Target": self.stack.target.port,
                "Draft": self.stack.draft.port}[service]
        ch = self.stack.channel(f"127.0.0.1:{port}")
        path = f"/specdec.v1.{service}/{method}"
        if service == "Orchestrator":
            return list(ch.unary_stream(path)(payload, timeout=timeout))
        return ch.unary_unary(path)(payload, timeout=timeout)

    def raw_stream(self, service: str, method: str, payloads: list[bytes], timeout: float = 30) -> Any:
        """A bidirectional stream of raw messages; the replies (raises for a non-OK status)."""
        port = {"Target": self.stack.target.port, "Draft": self.stack.draft.port}[service]
        ch = self.stack.channel(f"127.0.0.1:{port}")
        return list(ch.stream_stream(f"/specdec.v1.{service}/{method}")(iter(payloads), timeout=timeout))

    def verify_stream(self, requests: list[target_pb2.VerifyRequest]) -> Any:
        return self.raw_stream("Target", "VerifyStream", [r.SerializeToString() for r in requests])

    def gen(self, **fields: Any) -> Any:
        return self.stack.generate(**fields)

    def gen_with(self, **speculation: Any) -> Any:
        req = make_request(prompt="a", mode="auto")
        for k, v in speculation.items():
            setattr(req.speculation, k, v)
        return list(self.stack.orch_stub().Generate(req, timeout=30))

    def prefill(self, n: int = 3, temperature: float = 0.0) -> target_pb2.PrefillResponse:
        r = self.t.Prefill(target_pb2.PrefillRequest(
            token_ids=[1 + i % (VOCAB - 1) for i in range(n)], sample_next_token=True,
            sampling=common_pb2.SamplingParams(temperature=temperature)))
        self.target_sids.append(r.session_id)
        return r

    def verify(self, sid: str, cache_len: int, new: list[int], draft: list[int] = (), q: Any = (),
               timeout: float | None = 30) -> Any:
        return self.t.Verify(target_pb2.VerifyRequest(
            session_id=sid, cache_len=cache_len, new_token_ids=new, draft_token_ids=list(draft),
            draft_probs=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in q]), timeout=timeout)

    def sampled_verify(self, draft: list[int], q: Any) -> Any:
        pre = self.prefill(temperature=1.0)
        return self.verify(pre.session_id, pre.cache_len, [pre.next_token_id], draft, q)

    def draft_session(self, committed: list[int] | None = None) -> str:
        sid = self.d.CreateSession(draft_pb2.CreateDraftSessionRequest()).session_id
        self.draft_sids.append(sid)
        if committed:
            self.d.Propose(draft_pb2.ProposeRequest(session_id=sid, new_token_ids=committed, num_tokens=1))
        return sid

    def propose(self, sid: str | None = None, timeout: float | None = 30, **kw: Any) -> Any:
        kw.setdefault("num_tokens", 2)
        sid = self.draft_session([1, 2, 3]) if sid is None else sid
        return self.d.Propose(draft_pb2.ProposeRequest(session_id=sid, **kw), timeout=timeout)

    def released_target(self) -> str:
        sid = self.prefill().session_id
        self.t.Release(common_pb2.ReleaseRequest(session_id=sid))
        self.target_sids.remove(sid)
        return sid

    def released_draft(self) -> str:
        sid = self.draft_session()
        self.d.Release(common_pb2.ReleaseRequest(session_id=sid))
        self.draft_sids.remove(sid)
        return sid


def _cancel_mid_stream(c: Ctx) -> Any:
    call = c.stack.orch_stub().Generate(make_request(prompt="cancel me", max_new_tokens=400), timeout=60)
    next(call)
    assert c.stack.target_sessions() >= 1
    call.cancel()
    return list(call)


def _too_many_streams(c: Ctx) -> Any:
    stub = c.stack.orch_stub()
    open_calls = []
    try:
        for _ in range(MAX_STREAMS_PER_CLIENT):
            call = stub.Generate(make_request(prompt="hold", max_new_tokens=400), timeout=60)
            next(call)
            open_calls.append(call)
        return c.gen(prompt="one too many")
    finally:
        for call in open_calls:
            call.cancel()


def _release_twice(stub: Any, sid: str) -> Any:
    stub.Release(common_pb2.ReleaseRequest(session_id=sid))
    r = stub.Release(common_pb2.ReleaseRequest(session_id=sid))
    assert not r.released
    return r


def _double_release_target(c: Ctx) -> Any:
    sid = c.prefill().session_id
    c.target_sids.remove(sid)
    return _release_twice(c.t, sid)


def _double_release_draft(c: Ctx) -> Any:
    sid = c.draft_session()
    c.draft_sids.remove(sid)
    return _release_twice(c.d, sid)


def _unknown_release(stub: Any) -> Any:
    r = stub.Release(common_pb2.ReleaseRequest(session_id=uuid.uuid4().hex))
    assert not r.released
    return r


def _foreign_cache_len(c: Ctx) -> Any:
    a, b = c.prefill(3), c.prefill(7)
    return c.verify(a.session_id, b.cache_len, [a.next_token_id])


def _past_context(c: Ctx) -> Any:
    pre = c.prefill(CONTEXT - 10)
    return c.verify(pre.session_id, pre.cache_len, [1] * 12)


Run = Callable[[Ctx], Any]
ORCH: dict[str, tuple[S, Run]] = {
    "empty prompt": (S.INVALID_ARGUMENT, lambda c: c.gen()),
    "two prompt kinds": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", prompt_token_ids=[1])),
    "prompt and messages": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", messages=[("user", "b")])),
    "token id out of range": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt_token_ids=[1, 10_000])),
    "token id == vocab": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt_token_ids=[1, VOCAB])),
    "negative token id": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt_token_ids=[-1])),
    "negative temperature": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", temperature=-1.0)),
    "nan temperature": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", temperature=NAN)),
    "inf temperature": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", temperature=INF)),
    "huge temperature": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", temperature=1e6)),
    "top_p > 1": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", top_p=1.5, temperature=1.0)),
    "negative top_p": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", top_p=-0.5, temperature=1.0)),
    "nan top_p": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", top_p=NAN, temperature=1.0)),
    "negative top_k": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", top_k=-3, temperature=1.0)),
    "top_k > vocab": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", top_k=VOCAB + 1, temperature=1.0)),
    "max_new_tokens over limit": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", max_new_tokens=1_000_000)),
    "gamma over limit": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", gamma=1000)),
    "unknown drafter": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", drafter="no-such-drafter")),
    "prompt tokens exceed context": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt_token_ids=[1] * (CONTEXT + 88))),
    "prompt chars over limit": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a" * (MAX_PROMPT_CHARS + 1))),
    "empty stop string": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", stop=[""])),
    "too many stop strings": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", stop=["x"] * 17)),
    "stop string too long": (S.INVALID_ARGUMENT, lambda c: c.gen(prompt="a", stop=["x" * 257])),
    "empty role": (S.INVALID_ARGUMENT, lambda c: c.gen(messages=[("", "hi")])),
    "nan min_confidence": (S.INVALID_ARGUMENT, lambda c: c.gen_with(min_confidence=NAN)),
    "min_confidence 1": (S.INVALID_ARGUMENT, lambda c: c.gen_with(min_confidence=1.0)),
    "negative min_confidence": (S.INVALID_ARGUMENT, lambda c: c.gen_with(min_confidence=-0.1)),
    "unknown speculation mode": (S.INVALID_ARGUMENT, lambda c: c.raw("Orchestrator", "Generate",
                                                                   ld(1, b"a") + ld(7, b"\x08\x63"))),
    "non-utf8 prompt": (S.INVALID_ARGUMENT, lambda c: c.raw("Orchestrator", "Generate", ld(1, BAD_UTF8))),
    "non-utf8 stop string": (S.INVALID_ARGUMENT, lambda c: c.raw("Orchestrator", "Generate",
                                                               ld(1, b"a") + ld(6, BAD_UTF8))),
    "non-utf8 chat content": (S.INVALID_ARGUMENT, lambda c: c.raw("Orchestrator", "Generate",
                                                                ld(3, ld(1, b"user") + ld(2, BAD_UTF8)))),
    "garbage bytes": (S.INVALID_ARGUMENT, lambda c: c.raw("Orchestrator", "Generate", GARBAGE)),
    "oversized prompt": (S.RESOURCE_EXHAUSTED, lambda c: c.raw("Orchestrator", "Generate", ld(1, b"x" * OVERSIZE))),
    "deadline already expired": (S.DEADLINE_EXCEEDED, lambda c: c.stack.generate(prompt="a", timeout=-1)),
    "deadline mid-stream": (S.DEADLINE_EXCEEDED, lambda c: c.stack.generate(prompt="a", max_new_tokens=2000,
                                                                           timeout=0.3)),
    "client cancels mid-stream": (S.CANCELLED, _cancel_mid_stream),
    "too many streams per client": (S.RESOURCE_EXHAUSTED, _too_many_streams),
}

q = common_pb2.SparseDistribution
def _stream_good_then_garbage(c: Ctx) -> Any:
    """A served round, then bytes that do not parse: the stream ends with
    INVALID_ARGUMENT after the first reply; the session stays (released by the runner)."""
    pre = c.prefill()
    good = target_pb2.VerifyRequest(session_id=pre.session_id, cache_len=pre.cache_len,
                                    new_token_ids=[pre.next_token_id]).SerializeToString()
    return c.raw_stream("Target", "VerifyStream", [good, GARBAGE])


TARGET: dict[str, tuple[S, Run]] = {
    "prefill empty": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest())),
    "prefill id >= vocab": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(token_ids=[1, VOCAB]))),
    "prefill negative id": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(token_ids=[-7]))),
    "prefill exceeds context": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(
        token_ids=[1] * CONTEXT))),
    "prefill nan temperature": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(
        token_ids=[1], sampling=common_pb2.SamplingParams(temperature=NAN)))),
    "prefill top_p 2": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(
        token_ids=[1], sampling=common_pb2.SamplingParams(temperature=1, top_p=2)))),
    "prefill top_k > vocab": (S.INVALID_ARGUMENT, lambda c: c.t.Prefill(target_pb2.PrefillRequest(
        token_ids=[1], sampling=common_pb2.SamplingParams(temperature=1, top_k=VOCAB + 1)))),
    "prefill garbage bytes": (S.INVALID_ARGUMENT, lambda c: c.raw("Target", "Prefill", GARBAGE)),
    "prefill oversized": (S.RESOURCE_EXHAUSTED, lambda c: c.raw("Target", "Prefill", ld(1, b"\x01" * OVERSIZE))),
    "model info non-utf8": (S.INVALID_ARGUMENT, lambda c: c.raw("Target", "GetModelInfo", ld(1, BAD_UTF8))),
    "verify unknown session": (S.NOT_FOUND, lambda c: c.verify("nope", 0, [1])),
    "verify before prefill": (S.NOT_FOUND, lambda c: c.verify(uuid.uuid4().hex, 3, [1])),
    "verify empty session id": (S.INVALID_ARGUMENT, lambda c: c.verify("", 0, [1])),
    "verify released session": (S.NOT_FOUND, lambda c: c.verify(c.released_target(), 3, [1])),
    "verify draft session id": (S.NOT_FOUND, lambda c: c.verify(c.draft_session(), 0, [1])),
    "verify foreign cache_len": (S.FAILED_PRECONDITION, _foreign_cache_len),
    "verify no new tokens": (S.INVALID_ARGUMENT, lambda c: c.verify(c.prefill().session_id, 3, [])),
    "verify draft id >= vocab": (S.INVALID_ARGUMENT, lambda c: c.verify(c.prefill().session_id, 3, [1], [5000])),
    "verify negative new id": (S.INVALID_ARGUMENT, lambda c: c.verify(c.prefill().session_id, 3, [-1])),
    "verify span over limit": (S.INVALID_ARGUMENT, lambda c: c.verify(c.prefill().session_id, 3, [1],
                                                                      [2] * (TARGET_SPAN + 1))),
    "verify past context": (S.INVALID_ARGUMENT, _past_context),
    "verify non-utf8 session id": (S.INVALID_ARGUMENT, lambda c: c.raw("Target", "Verify", ld(1, BAD_UTF8))),
    "verify q negative": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [1.5, -0.5])])),
    "verify q unnormalised": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [0.9, 0.9])])),
    "verify q nan": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [NAN, 0.5])])),
    "verify q inf": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [INF, 0.0])])),
    "verify q ids/probs length mismatch": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [1.0])])),
    "verify q count != span": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2], [1.0]), ([3], [1.0])])),
    "verify q empty support": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([], [])])),
    "verify q duplicate ids": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 2], [0.5, 0.5])])),
    "verify q id out of vocab": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, VOCAB], [0.5, 0.5])])),
    "verify q support over limit": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify(
        [2], [(list(range(4097)), [1 / 4097] * 4097)])),
    "verify q zero at drafted token": (S.INVALID_ARGUMENT, lambda c: c.sampled_verify([2], [([2, 3], [0.0, 1.0])])),
    "verify deadline already expired": (S.DEADLINE_EXCEEDED, lambda c: c.verify(c.prefill().session_id, 3, [1],
                                                                                 timeout=-1)),
    "verify stream garbage bytes": (S.INVALID_ARGUMENT, lambda c: c.raw_stream("Target", "VerifyStream", [GARBAGE])),
    "verify stream non-utf8 session id": (S.INVALID_ARGUMENT, lambda c: c.raw_stream(
        "Target", "VerifyStream", [ld(1, BAD_UTF8)])),
    "verify stream garbage after a good round": (S.INVALID_ARGUMENT, _stream_good_then_garbage),
    "verify stream unknown session": (S.NOT_FOUND, lambda c: c.verify_stream(
        [target_pb2.VerifyRequest(session_id="feed", cache_len=3, new_token_ids=[1])])),
    "verify stream foreign cache_len": (S.FAILED_PRECONDITION, lambda c: c.verify_stream(
        [target_pb2.VerifyRequest(session_id=c.prefill().session_id, cache_len=9, new_token_ids=[1])])),
    "release empty session id": (S.INVALID_ARGUMENT, lambda c: c.t.Release(common_pb2.ReleaseRequest())),
    "release unknown session (idempotent)": (S.OK, lambda c: _unknown_release(c.t)),
    "release twice (idempotent)": (S.OK, _double_release_target),
}

DRAFT: dict[str, tuple[S, Run]] = {
    "create nan temperature": (S.INVALID_ARGUMENT, lambda c: c.d.CreateSession(draft_pb2.CreateDraftSessionRequest(
        sampling=common_pb2.SamplingParams(temperature=NAN)))),
    "create negative top_k": (S.INVALID_ARGUMENT, lambda c: c.d.CreateSession(draft_pb2.CreateDraftSessionRequest(
        sampling=common_pb2.SamplingParams(temperature=1, top_k=-1)))),
    "create unknown drafter": (S.INVALID_ARGUMENT, lambda c: c.d.CreateSession(
        draft_pb2.CreateDraftSessionRequest(drafter="nope"))),
    "create non-utf8 drafter": (S.INVALID_ARGUMENT, lambda c: c.raw("Draft", "CreateSession", ld(2, BAD_UTF8))),
    "model info unknown drafter": (S.INVALID_ARGUMENT, lambda c: c.d.GetModelInfo(
        common_pb2.ModelInfoRequest(drafter="nope"))),
    "propose unknown session": (S.NOT_FOUND, lambda c: c.propose("feed", new_token_ids=[1])),
    "propose target session id": (S.NOT_FOUND, lambda c: c.propose(c.prefill().session_id, new_token_ids=[1])),
    "propose released session": (S.NOT_FOUND, lambda c: c.propose(c.released_draft(), new_token_ids=[1])),
    "propose num_tokens 0": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[1], num_tokens=0)),
    "propose span over limit": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[1],
                                                                        num_tokens=DRAFT_SPAN + 1)),
    "propose id >= vocab": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[VOCAB])),
    "propose negative id": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[-5])),
    "propose nan min_confidence": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[1],
                                                                           min_confidence=NAN)),
    "propose min_confidence 2": (S.INVALID_ARGUMENT, lambda c: c.propose(base_len=3, new_token_ids=[1],
                                                                         min_confidence=2.0)),
    "propose base_len beyond committed": (S.FAILED_PRECONDITION, lambda c: c.propose(base_len=4, new_token_ids=[1])),
    "propose empty context": (S.INVALID_ARGUMENT, lambda c: c.propose(c.draft_session(), new_token_ids=[])),
    "propose non-utf8 session id": (S.INVALID_ARGUMENT, lambda c: c.raw("Draft", "Propose", ld(1, BAD_UTF8))),
    "propose garbage bytes": (S.INVALID_ARGUMENT, lambda c: c.raw("Draft", "Propose", GARBAGE)),
    "propose oversized": (S.RESOURCE_EXHAUSTED, lambda c: c.raw("Draft", "Propose", ld(3, b"\x01" * OVERSIZE))),
    "propose deadline already expired": (S.DEADLINE_EXCEEDED, lambda c: c.propose(new_token_ids=[1], timeout=-1)),
    "session stream garbage bytes": (S.INVALID_ARGUMENT, lambda c: c.raw_stream("Draft", "Session", [GARBAGE])),
    "release empty session id": (S.INVALID_ARGUMENT, lambda c: c.d.Release(common_pb2.ReleaseRequest())),
    "release unknown session (idempotent)": (S.OK, lambda c: _unknown_release(c.d)),
    "release twice (idempotent)": (S.OK, _double_release_draft),
}

#: the message (a regex) for the checks of specdec/validation.py: the same
#: mistake is worded the same in every service
OUTSIDE = r" contains token id {}, outside the vocabulary \[0, 34\)$"
MESSAGES = {
    "orchestrator: token id out of range": "^prompt_token_ids" + OUTSIDE.format(10_000),
    "orchestrator: token id == vocab": "^prompt_token_ids" + OUTSIDE.format(VOCAB),
    "orchestrator: negative token id": "^prompt_token_ids" + OUTSIDE.format(-1),
    "orchestrator: nan min_confidence": r"^speculation.min_confidence must be in \[0, 1\), got nan$",
    "orchestrator: min_confidence 1": r"^speculation.min_confidence must be in \[0, 1\), got 1.0$",
    "target: prefill id >= vocab": "^token_ids" + OUTSIDE.format(VOCAB),
    "target: prefill negative id": "^token_ids" + OUTSIDE.format(-7),
    "target: verify draft id >= vocab": "^draft_token_ids" + OUTSIDE.format(5000),
    "target: verify negative new id": "^new_token_ids" + OUTSIDE.format(-1),
    "target: verify q id out of vocab": r"^draft_probs\[0\].token_ids" + OUTSIDE.format(VOCAB),
    "draft: propose id >= vocab": "^new_token_ids" + OUTSIDE.format(VOCAB),
    "draft: propose negative id": "^new_token_ids" + OUTSIDE.format(-5),
    "draft: propose nan min_confidence": r"^min_confidence must be in \[0, 1\], got nan$",
    "draft: propose min_confidence 2": r"^min_confidence must be in \[0, 1\], got 2.0$",
}

CASES = {f"orchestrator: {k}": v for k, v in ORCH.items()}
CASES |= {f"target: {k}": v for k, v in TARGET.items()}
CASES |= {f"draft: {k}": v for k, v in DRAFT.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(stack: Stack, name: str) -> None:
    expected, run = CASES[name]
    c = Ctx(stack)
    try:
        try:
            run(c)
            code, details = S.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        assert code == expected, f"{name}: got {code.name} ({details}), want {expected.name}"
        if code not in (S.OK, S.CANCELLED, S.DEADLINE_EXCEEDED):
            assert details, "a rejection carries a message"
        if name in MESSAGES:
            assert re.search(MESSAGES[name], details), f"{name}: {details!r}"
        # the failed call itself created nothing (sessions the case made on purpose
        # aside); the orchestrator releases asynchronously, checked by assert_clean
        if not name.startswith("orchestrator"):
            assert stack.target_sessions() == len(c.target_sids)
            assert stack.draft_sessions() == len(c.draft_sids)
    finally:
        for sid in c.target_sids:
            c.t.Release(common_pb2.ReleaseRequest(session_id=sid))
        for sid in c.draft_sids:
            c.d.Release(common_pb2.ReleaseRequest(session_id=sid))
    stack.assert_clean()


def test_session_gauges_are_exact(stack: Stack) -> None:
    """The Prometheus session gauges (what operators read) follow the stores,
    also after calls that answer without touching the metrics."""
    c = Ctx(stack)

    def gauges() -> tuple[float | None, float | None]:
        target = scrape_metrics(stack.target.metrics_port)[("specdec_target_active_sessions", ())]
        return target, stack.draft.servicer.metrics.registry.get_sample_value("specdec_draft_active_sessions")

    c.prefill()
    c.draft_session()
    assert gauges() == (1.0, 1.0)
    c.t.Release(common_pb2.ReleaseRequest(session_id=c.target_sids[0]))
    c.d.Release(common_pb2.ReleaseRequest(session_id=c.draft_sids[0]))
    assert gauges() == (0.0, 0.0)
    stack.assert_clean()


def test_valid_requests_still_succeed_after_the_corpus(stack: Stack) -> None:
    """Runs last in this module: the services answer correctly after every bad input."""
    off = stack.generate(prompt="still fine", mode="off", max_new_tokens=12)
    spec = stack.generate(prompt="still fine", mode="fixed", gamma=4, max_new_tokens=12)
    assert spec["token_ids"] == off["token_ids"] and len(off["token_ids"]) == 12
    assert spec["stats"].draft_tokens > 0
    assert not math.isnan(spec["stats"].acceptance_rate)
    stack.assert_clean()
