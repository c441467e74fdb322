"""Sessions the caller names, so that a create call that fails on the
caller's side (cancelled, past its deadline, the reply lost) leaves nothing
behind (docs/reliability.md, "Sessions lost to a cancelled or expired
call"): id validation, the ids released before they existed (tombstones),
and the leak itself through real servers on loopback with tiny models,
where a proxy delays the reply past the caller's deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import grpc
import pytest

from draft_service.sessions import SessionStore
from specdec.errors import AlreadyExists, InvalidArgument, NotFound
from specdec.sampling import SamplingConfig
from specdec.session_ids import Tombstones, check_session_id, new_session_id
from specdec.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from target_service.calls import PrefillCall
from target_service.engine import TargetEngine
from tests.stack import Stack, start_stack
from tests.test_draft_sessions import Clock, EchoDrafter

BAD_IDS = ["a b", "x" * 65, "sess/1", "ü", "id\n", "../x"]


def _code(e: grpc.RpcError) -> grpc.StatusCode:
    return e.code()  # type: ignore[no-any-return]


# ---------------------------------------------------------------- plain parts
def test_session_ids_are_checked() -> None:
    for good in (new_session_id(), "a", "A-b_9", "x" * 64):
        check_session_id(good)
    for bad in BAD_IDS + [""]:
        with pytest.raises(InvalidArgument, match="session_id must be 1-64 characters"):
            check_session_id(bad)
    assert len(new_session_id()) == 32 and new_session_id() != new_session_id()


def test_tombstones_expire_and_are_bounded() -> None:
    clock = Clock()
    t = Tombstones(ttl_s=60.0, max_ids=3, clock=clock)
    t.add("a")
    clock.t = 30.0
    t.add("b")
    assert "a" in t and "b" in t and "c" not in t
    clock.t = 60.0  # a expires 60 s after it was added, b lives on
    assert "a" not in t and "b" in t
    for sid in ("c", "d", "e"):
        t.add(sid)
    assert len(t) == 3 and "b" not in t  # the oldest went first
    t.add("x" * 65)  # no create could use it: never kept
    t.add("bad id")
    assert len(t) == 3
    clock.t = 1000.0
    assert len(t) == 0


def test_draft_store_release_before_create_keeps_nothing() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=4, ttl_s=600, max_span=8, clock=clock)
    d = EchoDrafter()
    with pytest.raises(NotFound):  # the caller gave up on "early" before its create arrived
        store.release("early")
    with pytest.raises(NotFound, match="released before it was created"):
        store.create(d, SamplingConfig(), session_id="early")
    assert len(store) == 0 and store.created_total == 0
    s = store.create(d, SamplingConfig(), session_id="named")
    assert s.id == "named" and store.get("named") is s
    with pytest.raises(AlreadyExists):
        store.create(d, SamplingConfig(), session_id="named")
    assert len(store) == 1
    assert store.create(d, SamplingConfig()).id != "named"  # without one: a fresh id, as before
    clock.t = 61.0  # the tombstone expired: the id may be used again
    assert store.create(d, SamplingConfig(), session_id="early").id == "early"


@pytest.fixture(scope="module")
def engine(tiny_models) -> TargetEngine:  # type: ignore[no-untyped-def]
    return TargetEngine(tiny_models.target, dtype="float32", max_sessions=8, kv_budget_tokens=4096)


def test_engine_release_before_or_during_the_prefill_keeps_nothing(engine: TargetEngine) -> None:
    """The race the tombstones close: a Release for a named session that
    reaches the target before its Prefill ran, or while it runs (between the
    batch's start and the session's insertion), leaves no session; the
    Prefill answers NOT_FOUND."""
    assert engine.release("before") is False
    with pytest.raises(NotFound, match="released before its Prefill"):
        engine.prefill([1, 2, 3], SamplingConfig(), True, session_id="before")
    assert engine.num_sessions == 0

    forward = engine._forward

    def released_mid_forward(*args: Any) -> Any:
        assert engine.release("during") is False  # no session yet: it is being computed
        return forward(*args)

    engine._forward = released_mid_forward  # type: ignore[method-assign]
    try:
        with pytest.raises(NotFound):
            engine.prefill([1, 2, 3], SamplingConfig(), True, session_id="during")
    finally:
        del engine._forward
    assert engine.num_sessions == 0

    out = engine.prefill([1, 2, 3], SamplingConfig(), True, session_id="mine")
    assert out.session_id == "mine" and engine.num_sessions == 1
    with pytest.raises(AlreadyExists):
        engine.prefill([4], SamplingConfig(), True, session_id="mine")
    # one id twice in one batch: one session, one ALREADY_EXISTS
    outs = [o for o, _ in engine.run_batch([PrefillCall([5, 6], SamplingConfig(), True, requested_id="twice")] * 2)]
    assert [type(o).__name__ for o in outs] == ["PrefillOutcome", "AlreadyExists"]
    assert engine.release("mine") and engine.release("twice") and engine.num_sessions == 0


# ------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def stack(tiny_models, tiny_onnx) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, tiny_onnx.cache_dir,
                    target_overrides={"backend": "eager", "calibrate": False})
    try:
        yield s
    finally:
        s.close()


def test_named_sessions_on_the_servers_statuses(stack: Stack) -> None:
    """Prefill and CreateSession use the caller's id; a malformed one is
    INVALID_ARGUMENT, one in use ALREADY_EXISTS, one released before it
    existed NOT_FOUND (and no session is kept); without one the server picks
    an id, as for an older client."""
    t, d = stack.target_stub(), stack.draft_stub()

    def prefill(sid: str) -> target_pb2.PrefillResponse:
        return t.Prefill(target_pb2.PrefillRequest(token_ids=[1, 2, 3], sample_next_token=True, session_id=sid),
                         timeout=30)

    def create(sid: str) -> draft_pb2.CreateDraftSessionResponse:
        return d.CreateSession(draft_pb2.CreateDraftSessionRequest(session_id=sid), timeout=30)

    for call in (prefill, create):
        for bad in BAD_IDS:
            with pytest.raises(grpc.RpcError) as err:
                call(bad)
            assert _code(err.value) == grpc.StatusCode.INVALID_ARGUMENT, (call, bad)
            assert "session_id must be 1-64 characters" in (err.value.details() or "")
        sid = new_session_id()
        assert call(sid).session_id == sid
        with pytest.raises(grpc.RpcError) as err:
            call(sid)
        assert _code(err.value) == grpc.StatusCode.ALREADY_EXISTS
        gone = new_session_id()
        release = t.Release if call is prefill else d.Release
        assert release(common_pb2.ReleaseRequest(session_id=gone), timeout=5).released is False
        with pytest.raises(grpc.RpcError) as err:
            call(gone)
        assert _code(err.value) == grpc.StatusCode.NOT_FOUND
        own = call("").session_id
        assert len(own) == 32 and own != sid
        for x in (sid, own):
            assert release(common_pb2.ReleaseRequest(session_id=x), timeout=5).released
    stack.wait_no_sessions(timeout_s=1.0)


def _proxied_stack(tiny_models, tiny_onnx, proxies: dict[str, Any], **orch: Any) -> Stack:  # type: ignore[no-untyped-def]
    from tests.faults import FaultyProxy

    async def interpose(t: str, d: str) -> tuple[str, str]:
        proxies["target"] = await FaultyProxy.start("specdec.v1.Target", t)
        proxies["draft"] = await FaultyProxy.start("specdec.v1.Draft", d)
        proxies["target_upstream"] = t
        return proxies["target"].address, proxies["draft"].address

    return start_stack(tiny_models.target, tiny_models.draft, tiny_onnx.cache_dir, interpose=interpose,
                       target_overrides={"backend": "eager", "calibrate": False},
                       orchestrator_overrides={"target_verify_stream": False, **orch})


async def _late(response: Any, seconds: float = 1.5) -> Any:
    await asyncio.sleep(seconds)  # the caller's deadline passes meanwhile: it never sees this reply
    return response


def test_a_prefill_reply_that_comes_after_the_deadline_leaves_no_session(tiny_models, tiny_onnx) -> None:  # type: ignore[no-untyped-def]
    """The target creates the session and answers, but the reply reaches
    the orchestrator after the request's deadline (a proxy holds it): the
    request ends DEADLINE_EXCEEDED and the session is released at once, not
    after the 600 s idle TTL."""
    proxies: dict[str, Any] = {}
    s = _proxied_stack(tiny_models, tiny_onnx, proxies)
    try:
        proxies["target"].on_response["Prefill"] = lambda req, resp: _late(resp)
        for mode in ("off", "fixed"):
            with pytest.raises(grpc.RpcError) as err:
                s.generate(timeout=0.5, prompt="late reply", mode=mode, max_new_tokens=8)
            assert _code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert proxies["target"].calls["Prefill"] == 2
        s.wait_no_sessions(timeout_s=3.0)
        del proxies["target"].on_response["Prefill"]
        assert len(s.generate(prompt="late reply", mode="fixed", max_new_tokens=8)["token_ids"]) == 8
        s.assert_clean(timeout_s=3.0)
    finally:
        s.close()


def test_a_draft_session_created_after_the_call_timed_out_is_released(tiny_models, tiny_onnx) -> None:  # type: ignore[no-untyped-def]
    """The draft's CreateSession reply comes after the orchestrator's draft
    timeout: the request goes on target-only and completes, and every draft
    session those creates made is released (the draft would hold them for
    its idle TTL)."""
    proxies: dict[str, Any] = {}
    s = _proxied_stack(tiny_models, tiny_onnx, proxies, draft_timeout_s=0.3)
    try:
        proxies["draft"].on_response["CreateSession"] = lambda req, resp: _late(resp, 1.0)
        r = s.generate(prompt="late draft", mode="fixed", max_new_tokens=8)
        assert len(r["token_ids"]) == 8 and proxies["draft"].calls["CreateSession"] >= 1
        s.assert_clean(timeout_s=3.0)
    finally:
        s.close()


def test_a_release_that_overtakes_its_prefill_leaves_no_session(tiny_models, tiny_onnx) -> None:  # type: ignore[no-untyped-def]
    """The network delivers the Prefill late, after the caller gave up and
    its Release of the id it chose reached the target: the Prefill that
    arrives then answers NOT_FOUND and keeps nothing."""
    proxies: dict[str, Any] = {}
    s = _proxied_stack(tiny_models, tiny_onnx, proxies)
    late: list[Any] = []

    async def deliver_late(req: Any) -> None:
        await asyncio.sleep(1.0)
        async with grpc.aio.insecure_channel(proxies["target_upstream"]) as ch:
            try:
                late.append(await target_pb2_grpc.TargetStub(ch).Prefill(req, timeout=30))
            except grpc.aio.AioRpcError as e:
                late.append(e.code())

    async def hold(req: Any, context: Any) -> Any:
        asyncio.ensure_future(deliver_late(req))  # outlives this call, as a packet in flight
        await asyncio.sleep(3600)  # the caller's deadline ends this call

    try:
        proxies["target"].on_request["Prefill"] = hold
        with pytest.raises(grpc.RpcError) as err:
            s.generate(timeout=0.4, prompt="overtaken", mode="off", max_new_tokens=4)
        assert _code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while not late and time.monotonic() < deadline:
            time.sleep(0.05)
        assert late == [grpc.StatusCode.NOT_FOUND]
        assert proxies["target"].calls["Release"] == 1
        s.wait_no_sessions(timeout_s=1.0)
    finally:
        s.close()
