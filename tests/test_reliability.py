"""Trust under faults and hostile input (issue 25, docs/reliability.md): one
bad request never looks like a dead replica, nothing leaks under overload,
and a rebuild never moves a session to other numerics.

Real services on loopback with tiny random-weight models: a target + draft +
orchestrator stack for the sampling fuzz and its /metrics, and small
purpose-built stacks for the rest (a target whose weights are corrupt, a
full model queue, a proxy that loses one Verify, two targets of different
numerics)."""

from __future__ import annotations

import asyncio
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import torch

from specdec.errors import Internal, InvalidArgument, Unavailable, from_rpc_error
from specdec.sampling import MAX_TOP_K, TEMPERATURE_FLOOR, SamplingConfig, processed_logits
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from tests.stack import LoopThread, Stack, free_port, make_request, scrape_metrics, start_stack

F32 = np.float32


def f32(x: float) -> float:
    """``x`` as a proto ``float`` field carries it."""
    return float(F32(x))


def nextafter32(x: float, toward: float) -> float:
    return float(np.nextafter(F32(x), F32(toward)))


VOCAB = 34  # tests/conftest.py TINY_CHARS
# (temperature, top_p, top_k) at the float edges; top_p 0 = unset
VALID = [
    (0.0, 0.0, 0), (-0.0, 0.0, 0), (1e-45, 0.0, 0), (1e-39, 0.0, 0), (f32(1.1754944e-38), 0.0, 0),
    (nextafter32(TEMPERATURE_FLOOR, 0.0), 0.0, 0), (f32(TEMPERATURE_FLOOR), 0.0, 0), (1.0, 0.0, 0), (100.0, 0.0, 0),
    (1.0, 1e-45, 0), (1.0, 1e-38, 0), (1.0, nextafter32(1.0, 0.0), 0), (1.0, 1.0, 0),
    (1.0, float(np.nextafter(0.0, -1.0)), 0),  # rounds to -0.0 in float32: unset
    (1.0, 0.0, 1), (1.0, 0.0, VOCAB - 1), (1.0, 0.0, VOCAB), (1e-39, 1e-45, 1), (100.0, 1e-45, VOCAB),
]
# the orchestrator refuses a top_k past the vocabulary; the model services may take it (= no truncation)
PAST_VOCAB = [(1.0, 0.0, VOCAB + 1), (1.0, 0.0, MAX_TOP_K), (100.0, 1e-45, MAX_TOP_K)]
POISON = [
    (-1e-45, 0.0, 0), (-1.0, 0.0, 0), (nextafter32(100.0, 200.0), 0.0, 0), (3.4e38, 0.0, 0),
    (math.inf, 0.0, 0), (-math.inf, 0.0, 0), (math.nan, 0.0, 0),
    (1.0, -1e-45, 0), (1.0, nextafter32(1.0, 2.0), 0), (1.0, 2.0, 0), (1.0, math.inf, 0), (1.0, math.nan, 0),
    (1.0, -math.inf, 0),
    (1.0, 0.0, -1), (1.0, 0.0, MAX_TOP_K + 1), (1.0, 0.0, 2**31 - 1), (1.0, 0.0, -(2**31)),
]


def _greedy_like(t: float, p: float, k: int) -> bool:
    """Configs whose output is the greedy output: a temperature under the
    floor, or a single-token support (top-k 1, a subnormal top-p)."""
    return SamplingConfig(t, p or 1.0, k).greedy or k == 1 or (0.0 < p < 1e-30)


def _code(e: grpc.RpcError) -> grpc.StatusCode:
    return e.code()  # type: ignore[no-any-return]


# ------------------------------------------------------------------- units
def test_only_unavailable_is_unavailable() -> None:
    class Err(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return "x"

    assert isinstance(from_rpc_error(Err(grpc.StatusCode.UNAVAILABLE), "t"), Unavailable)
    assert isinstance(from_rpc_error(Err(grpc.StatusCode.INVALID_ARGUMENT), "t"), InvalidArgument)
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.PERMISSION_DENIED):
        e = from_rpc_error(Err(code), "t")
        assert isinstance(e, Internal) and not isinstance(e, Unavailable), code
        assert e.code == code


def test_temperatures_below_the_floor_are_greedy_and_never_overflow() -> None:
    for t in (1e-45, 1e-39, 1e-30, nextafter32(TEMPERATURE_FLOOR, 0.0)):
        cfg = SamplingConfig(temperature=t)
        assert cfg.greedy and cfg.temperature == 0.0, t
    assert not SamplingConfig(temperature=TEMPERATURE_FLOOR).greedy
    logits = torch.tensor([[3.0e4, -2.0e4, 1.0]])  # large but real logits: finite at the floor
    x = processed_logits(logits, SamplingConfig(temperature=TEMPERATURE_FLOOR))
    assert not torch.isnan(x).any() and x.argmax().item() == 0
    with pytest.raises(Internal, match="non-finite"):
        processed_logits(torch.tensor([[float("nan"), 1.0]]), SamplingConfig(temperature=1.0))


# --------------------------------------------------- fuzz through the stack
@pytest.fixture(scope="module")
def stack(tiny_models, tiny_onnx) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, tiny_onnx.cache_dir,
                    # a draft stalled by a loaded machine is not what this tests
                    orchestrator_overrides={"metrics_port": free_port(), "draft_timeout_s": 30.0})
    try:
        yield s
    finally:
        s.close()


def _orch_metrics(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return scrape_metrics(stack.orchestrator.servicer.metrics_port)


def _sum(metrics: dict[Any, float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def test_sampling_float_edges_get_a_result_or_invalid_argument_and_metrics_say_so(stack: Stack) -> None:
    """Every edge gets a complete stream or INVALID_ARGUMENT; the poison ones
    are counted under INVALID_ARGUMENT on the orchestrator's /metrics, no
    replica is marked failed and no session is rebuilt or left behind; the
    next request is served as before."""
    prompt = "hello world"
    greedy = stack.generate(prompt=prompt, mode="off", max_new_tokens=8)["token_ids"]
    before = _orch_metrics(stack)
    for t, p, k in VALID:
        for mode in ("off", "fixed"):
            r = stack.generate(prompt=prompt, mode=mode, max_new_tokens=8, temperature=t, top_p=p, top_k=k, seed=3)
            assert len(r["token_ids"]) == 8 and all(0 <= i < VOCAB for i in r["token_ids"]), (t, p, k, mode)
            if _greedy_like(t, p, k):
                assert r["token_ids"] == greedy, (t, p, k, mode)
    valid_done = _orch_metrics(stack)
    poison = POISON + PAST_VOCAB
    for t, p, k in poison:
        with pytest.raises(grpc.RpcError) as err:
            stack.generate(prompt=prompt, mode="fixed", max_new_tokens=8, temperature=t, top_p=p, top_k=k)
        assert _code(err.value) == grpc.StatusCode.INVALID_ARGUMENT, (t, p, k, err.value)
        assert "sampling." in (err.value.details() or ""), err.value.details()
    after = _orch_metrics(stack)
    name, failures = "specdec_requests_total", "specdec_orchestrator_upstream_failures_total"
    assert _sum(after, name, code="INVALID_ARGUMENT") - _sum(valid_done, name, code="INVALID_ARGUMENT") == len(poison)
    assert _sum(after, name) - _sum(valid_done, name) == len(poison)  # under no other code: no UNAVAILABLE
    assert _sum(after, failures) == _sum(valid_done, failures)  # no replica marked failed by them
    assert _sum(valid_done, name, code="OK") - _sum(before, name, code="OK") == 2 * len(VALID)
    assert _sum(valid_done, name) - _sum(before, name) == 2 * len(VALID)
    assert _sum(after, failures, service="target") == 0
    assert _sum(after, "specdec_target_session_rebuilds_total") == 0
    assert _sum(after, "specdec_orchestrator_upstream_replicas", service="target", state="unavailable") == 0
    assert _sum(after, "specdec_orchestrator_upstream_replicas", service="target", state="available") == 1
    assert stack.generate(prompt=prompt, mode="fixed", max_new_tokens=8)["token_ids"] == greedy
    stack.assert_clean()


def test_sampling_float_edges_on_the_target_and_draft_directly(stack: Stack) -> None:
    """The same edges straight at the target's Prefill and the draft's
    CreateSession: OK or INVALID_ARGUMENT, the servers stay SERVING."""
    target, draft = stack.target_stub(), stack.draft_stub()
    for t, p, k in VALID + POISON + PAST_VOCAB:
        sampling = common_pb2.SamplingParams(temperature=t, top_p=p, top_k=k, seed=1)
        try:
            r = target.Prefill(target_pb2.PrefillRequest(token_ids=[1, 2, 3], sampling=sampling,
                                                         sample_next_token=True), timeout=30)
            assert (t, p, k) not in POISON and 0 <= r.next_token_id < VOCAB, (t, p, k)
            target.Release(common_pb2.ReleaseRequest(session_id=r.session_id), timeout=30)
        except grpc.RpcError as e:
            assert (t, p, k) not in VALID and _code(e) == grpc.StatusCode.INVALID_ARGUMENT, (t, p, k, e)
        try:
            d = draft.CreateSession(draft_pb2.CreateDraftSessionRequest(sampling=sampling), timeout=30)
            prop = draft.Propose(draft_pb2.ProposeRequest(session_id=d.session_id, base_len=0,
                                                          new_token_ids=[1, 2, 3], num_tokens=3), timeout=30)
            assert (t, p, k) not in POISON and len(prop.token_ids) == 3, (t, p, k)
            draft.Release(common_pb2.ReleaseRequest(session_id=d.session_id), timeout=30)
        except grpc.RpcError as e:
            assert (t, p, k) not in VALID and _code(e) == grpc.StatusCode.INVALID_ARGUMENT, (t, p, k, e)
    stack.assert_clean()


# ------------------------------------------- a server fault is INTERNAL
def _corrupt_copy(src: Path, dst: Path) -> Path:
    """The tiny target with a NaN output head: every logit NaN (corrupt weights)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    w = load_file(str(f))
    w["lm_head.weight"] = torch.full_like(w["lm_head.weight"], float("nan"))
    save_file(w, str(f), metadata={"format": "pt"})
    return dst


def test_a_server_fault_is_internal_and_backs_no_replica_off(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A target that produces NaN logits fails a sampled request with
    INTERNAL (not UNAVAILABLE): no replica is backed off, nothing rebuilt,
    counted under INTERNAL, and greedy requests are still served."""
    bad = _corrupt_copy(tiny_models.target, tmp_path / "nan-target")
    s = start_stack(bad, None, tmp_path / "cache",
                    target_overrides={"backend": "eager", "calibrate": False},
                    orchestrator_overrides={"metrics_port": free_port()})
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.generate(prompt_token_ids=[1, 2, 3], mode="off", max_new_tokens=4, temperature=1.0)
        assert _code(err.value) == grpc.StatusCode.INTERNAL, err.value
        assert "non-finite logits" in (err.value.details() or "")
        # the server counts the request just after the client has its status: wait for it
        deadline = time.monotonic() + 10
        while _sum(m := _orch_metrics(s), "specdec_requests_total", code="INTERNAL") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sum(m, "specdec_requests_total", code="INTERNAL") == 1
        assert _sum(m, "specdec_requests_total", code="UNAVAILABLE") == 0
        assert _sum(m, "specdec_orchestrator_upstream_failures_total") == 0
        assert _sum(m, "specdec_target_session_rebuilds_total") == 0
        pool = s.orchestrator.servicer.target.pool
        assert all(r.available(pool.clock()) and r.failures == 0 for r in pool.replicas.values())
        assert len(s.generate(prompt_token_ids=[1, 2, 3], mode="off", max_new_tokens=4)["token_ids"]) == 4
        s.assert_clean()
    finally:
        s.close()


# ------------------------------------ Release and the reaper under overload
def test_release_and_reaper_work_while_the_model_queue_is_full(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the model queue full (a job holds the model thread, max_queue 1),
    Release still frees a session and the idle reaper keeps running (and
    reaps); the server then stops cleanly."""
    from target_service.config import TargetServiceConfig
    from target_service.server import start

    loop = LoopThread()
    srv = loop.run(start(TargetServiceConfig(model=str(tiny_models.target), port=0, dtype="float32",
                                             backend="eager", calibrate=False, cache_dir=tmp_path,
                                             max_queue=1, session_ttl_s=1.0)))
    stack = Stack(loop, srv, None, None)
    try:
        stub = stack.target_stub()
        a = stub.Prefill(target_pb2.PrefillRequest(token_ids=[1, 2, 3]), timeout=30)
        b = stub.Prefill(target_pb2.PrefillRequest(token_ids=[4, 5, 6]), timeout=30)
        assert srv.engine.num_sessions == 2
        busy = asyncio.run_coroutine_threadsafe(srv.worker.run(time.sleep, 4.0), loop.loop)
        deadline = time.monotonic() + 5
        while srv.worker.pending < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:  # the queue is full indeed
            stub.Prefill(target_pb2.PrefillRequest(token_ids=[7]), timeout=30)
        assert _code(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = stub.Release(common_pb2.ReleaseRequest(session_id=a.session_id), timeout=2)
        assert r.released and srv.engine.num_sessions == 1
        # b idles past the TTL while the queue stays full: the reaper frees it
        deadline = time.monotonic() + 3.5
        while srv.engine.num_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.engine.num_sessions == 0, "the reaper did not run while the queue was full"
        assert not srv.reaper.done(), "the reaper task ended"
        busy.result(10)
        stub.Release(common_pb2.ReleaseRequest(session_id=b.session_id), timeout=5)
    finally:
        for ch in stack.channels:
            ch.close()
        loop.run(srv.stop(0))  # raises if the reaper died with an error
        loop.close()


# ----------------------------- what a transient failure leaves is released
def test_a_transient_verify_failure_releases_the_session_it_leaves(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One Verify lost on the way (UNAVAILABLE from a proxy, the target's
    session still alive): the request is rebuilt and completes exactly, and
    the session it left behind is released at once, not after the TTL."""
    from tests.faults import FaultyProxy

    proxies: dict[str, FaultyProxy] = {}

    async def interpose(t: str, d: str) -> tuple[str, str]:
        proxies["target"] = await FaultyProxy.start("specdec.v1.Target", t)
        return proxies["target"].address, d

    s = start_stack(tiny_models.target, None, tmp_path, interpose=interpose,
                    target_overrides={"backend": "eager", "calibrate": False},
                    orchestrator_overrides={"target_verify_stream": False})
    try:
        ref = s.generate(prompt="leak", mode="off", max_new_tokens=12)["token_ids"]
        n = {"verify": 0}

        async def lose_one(req: Any, context: Any) -> Any:
            n["verify"] += 1
            if n["verify"] == 3:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (test)")
            return req

        proxies["target"].on_request["Verify"] = lose_one
        r = s.generate(prompt="leak", mode="off", max_new_tokens=12)
        assert r["token_ids"] == ref and r["stats"].target_rebuilds == 1
        s.wait_no_sessions(timeout_s=3.0)  # the TTL is 600 s: only a release frees it this soon
    finally:
        s.close()


# ------------------------------------------------ bf16w threads as calibrated
@pytest.mark.skipif(not __import__("target_service.bf16w", fromlist=["available"]).available()[0],
                    reason="bf16w needs an x86-64 CPU with AVX2/FMA and a C compiler")
def test_bf16w_target_with_threads_keeps_torch_on_one_thread(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--threads 2 --backend bf16w`` with start-up calibration (which
    hands its measured model to the engine): the served model thread runs
    torch on one thread and the kernel on both, as calibration measured it."""
    from target_service import backends, bf16w
    from target_service.config import TargetServiceConfig
    from target_service.server import start

    saved = (backends._compute_threads, bf16w._threads)
    loop = LoopThread()
    srv = loop.run(start(TargetServiceConfig(model=str(tiny_models.target), port=0, dtype="bfloat16", backend="bf16w",
                                             threads=2, calibration_budget_s=2.0, cache_dir=tmp_path, warmup=False)))
    try:
        torch_threads, _ = loop.run(srv.worker.run(torch.get_num_threads))
        assert torch_threads == 1
        assert bf16w._threads == 2
        assert srv.engine.backend == "bf16w"
    finally:
        loop.run(srv.stop(0))
        loop.close()
        backends._compute_threads, bf16w._threads = saved


# --------------------------------------- rebuilds stay on the same numerics
def test_a_rebuild_never_moves_a_session_to_other_numerics(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two real targets, float32 and bfloat16, behind proxies. The replica
    holding a request's session dies mid-stream (every call UNAVAILABLE from
    then on): the rebuild is not placed on the bfloat16 (or float32) peer,
    whose output could differ; the request fails UNAVAILABLE and says why."""
    from orchestrator.config import OrchestratorConfig, RoutingConfig
    from orchestrator.server import start as start_orch
    from target_service.config import TargetServiceConfig
    from target_service.server import start as start_target
    from tests.faults import FaultyProxy

    loop = LoopThread()
    targets = [loop.run(start_target(TargetServiceConfig(model=str(tiny_models.target), port=0, dtype=dt,
                                                         backend="eager", calibrate=False, cache_dir=tmp_path)))
               for dt in ("float32", "bfloat16")]
    proxies = [loop.run(FaultyProxy.start("specdec.v1.Target", f"127.0.0.1:{t.port}")) for t in targets]
    dead: set[int] = set()

    def hooks(i: int) -> None:
        async def verify(req: Any, context: Any) -> Any:
            if not dead:
                dead.add(i)  # the replica that serves the first Verify dies now
            if i in dead:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica gone (test)")
            return req

        async def prefill(req: Any, context: Any) -> Any:
            if i in dead:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica gone (test)")
            return req

        proxies[i].on_request["Verify"] = verify
        proxies[i].on_request["Prefill"] = prefill

    for i in range(2):
        hooks(i)
    orch = loop.run(start_orch(OrchestratorConfig(
        target_addresses=[p.address for p in proxies], tokenizer=str(tiny_models.target), port=0,
        cache_dir=tmp_path, target_verify_stream=False, routing=RoutingConfig(health_interval_s=0.2))))
    s = Stack(loop, targets[0], None, orch)
    try:
        pool = orch.servicer.target.pool
        assert sorted(r.numerics for r in pool.replicas.values()) == ["bfloat16/eager", "float32/eager"]
        with pytest.raises(grpc.RpcError) as err:
            s.generate(prompt="numerics", mode="off", max_new_tokens=12)
        assert _code(err.value) == grpc.StatusCode.UNAVAILABLE, err.value
        (holder,) = dead
        peer = 1 - holder
        assert proxies[peer].calls.get("Prefill", 0) == 0, "the session was rebuilt on the other numerics"
        assert proxies[holder].calls.get("Prefill", 0) == 2  # the session, then the refused rebuild
        assert targets[peer].engine.num_sessions == 0
        # a new request is served by the live peer (a first session may go anywhere)
        dead.add(holder)
        assert len(s.generate(prompt="numerics", mode="off", max_new_tokens=12)["token_ids"]) == 12
    finally:
        for ch in s.channels:
            ch.close()
        loop.run(orch.stop(0))
        for p in proxies:
            loop.run(p.stop())
        for t in targets:
            loop.run(t.stop(0))
        loop.close()
