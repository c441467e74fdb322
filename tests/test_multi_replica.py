"""Two target and two (then three) draft replicas as real ``specdec serve``
processes on loopback, one in-process orchestrator routing over them: the
targets as a static comma list, the drafts through a ``file://`` endpoints
file that the test edits (the stand-in for a headless Service's DNS).

The tests run in order on one cluster and each leaves it as the next one
expects: affinity (2 targets, 2 drafts) → a draft replica added (3 drafts) →
one target and one draft SIGKILLed mid-stream (1 target, 2 drafts) → the last
target drained with SIGTERM (0 targets). About 60 s in all.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest

from orchestrator.config import OrchestratorConfig, RoutingConfig
from tests.stack import (
    LoopThread,
    ServiceProcess,
    Stack,
    free_port,
    make_request,
    scrape_metrics,
    start_service_process,
    start_stack,
)

N_REQUESTS = 12
MAX_NEW = 120
PROMPTS = [f"{w} request {i}" for i, w in enumerate("abcdefghijkl")]


@dataclass
class Cluster:
    stack: Stack  # the orchestrator (stack.target / stack.draft are unused: None)
    targets: list[ServiceProcess]
    drafts: list[ServiceProcess]
    endpoints_file: Path
    refs: dict[str, list[int]]  # OFF (target-only) reference output per prompt
    start_draft: Callable[[], ServiceProcess]

    @property
    def orch(self) -> Any:
        return self.stack.orchestrator

    def orch_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape_metrics(self.orch.servicer.metrics_port)

    def set_drafts(self, drafts: list[ServiceProcess]) -> None:
        self.endpoints_file.write_text("".join(f"{d.address}\n" for d in drafts))

    def wait_draft_available(self, address: str, timeout_s: float = 20.0) -> None:
        pool = self.orch.servicer.draft.pool
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = pool.replicas.get(address)
            if r is not None and r.available(pool.clock()):
                return
            time.sleep(0.05)
        raise AssertionError(f"draft replica {address} never became available")


@pytest.fixture(scope="module")
def cluster(tiny_models, tiny_onnx, tmp_path_factory) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    from orchestrator.server import start as start_orch

    cache = tiny_onnx.cache_dir

    procs: list[ServiceProcess] = []  # every process started, killed at teardown

    def start_draft() -> ServiceProcess:
        procs.append(start_service_process("draft", tiny_models.draft, cache))
        return procs[-1]

    # one numerics on both (a rebuild never moves a session to other numerics,
    # and two nodes calibrating at once could pick different backends)
    procs += [start_service_process("target", tiny_models.target, cache, backend="eager") for _ in range(2)]
    for _ in range(2):
        start_draft()
    loop = LoopThread()
    try:
        for p in procs:
            p.wait_serving()
        targets, drafts = procs[:2], procs[2:]
        eps = tmp_path_factory.mktemp("routing") / "draft-endpoints"
        eps.write_text("".join(f"{d.address}\n" for d in drafts))
        cfg = OrchestratorConfig(
            target_addresses=[t.address for t in targets], draft_addresses=[f"file://{eps}"],
            tokenizer=str(tiny_models.target), port=0, cache_dir=cache, metrics_port=free_port(),
            draft_timeout_s=2.0, speculation_max_streams=0, routing=RoutingConfig(discovery_interval_s=0.3, health_interval_s=0.2, backoff_s=1.0),
        )
        orch = loop.run(start_orch(cfg))
        stack = Stack(loop, None, None, orch)
        deadline = time.monotonic() + 60
        while orch.servicer.draft is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orch.servicer.draft is not None, "draft was not attached"
        refs = dict(zip(PROMPTS, run_all(stack, PROMPTS, mode="off")))
        yield Cluster(stack, targets, drafts, eps, refs, start_draft)
    finally:
        for p in procs:
            p.kill()
        if "orch" in locals():
            for ch in stack.channels:
                ch.close()
            loop.run(orch.stop(0))
        loop.close()


def run_all(stack: Stack, prompts: list[str], mode: str = "fixed",
            on_started: Callable[[], None] | None = None) -> list[Any]:
    """Runs one greedy stream per prompt concurrently and returns the token ids
    of each (``mode="off"``) or dicts with token ids and the final stats.
    ``on_started`` runs once every stream has received two chunks (the
    prefill token and a verified round), while they are still going."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(prompts) + 1)

    def worker(i: int, prompt: str) -> None:
        try:
            req = make_request(prompt=prompt, mode=mode, gamma=3, max_new_tokens=MAX_NEW)
            stream = stack.orch_stub().Generate(req, timeout=120)
            chunks = [next(stream), next(stream)]
            if on_started is not None:
                started.wait(timeout=60)
            chunks += list(stream)
            ids = [t for c in chunks for t in c.token_ids]
            results[i] = ids if mode == "off" else {"ids": ids, "stats": chunks[-1].stats}
        except BaseException as e:  # reported below
            errors.append(e)
            started.abort()

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    if on_started is not None:
        started.wait(timeout=60)
        on_started()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    return [results[i] for i in range(len(prompts))]


def assert_exact(cl: Cluster, prompts: list[str], results: list[dict[str, Any]]) -> None:
    for p, r in zip(prompts, results):
        assert r["ids"] == cl.refs[p], p
        assert len(r["ids"]) == MAX_NEW


def created(metrics: dict[Any, float], address: str) -> float:
    return metrics.get(("specdec_orchestrator_target_sessions_created_total", (("replica", address),)), 0.0)


def test_health_port_serves_only_health_in_plaintext() -> None:
    """The plaintext probe port mirrors the service's health and exposes nothing else."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.grpc_util import start_server
    from specdec.v1 import common_pb2, target_pb2_grpc

    loop = LoopThread()
    handle = loop.run(start_server(lambda server: None, ["specdec.v1.Target"], "127.0.0.1", 0, health_port=free_port()))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            loop.run(handle.set_serving(True))
            for name in ("", "specdec.v1.Target"):
                r = stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        loop.run(handle.stop(0))
        loop.close()


def test_orchestrator_drain_finishes_streams_and_refuses_new_ones(tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Step one of the orchestrator's SIGTERM handling: health NOT_SERVING and
    new streams UNAVAILABLE at once, the running stream completes, then the
    drain returns."""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    try:
        off = st.generate(prompt="drain me", mode="off", max_new_tokens=240)
        stream = st.orch_stub().Generate(make_request(prompt="drain me", max_new_tokens=240), timeout=120)
        chunks = [next(stream)]
        drained = asyncio.run_coroutine_threadsafe(st.orchestrator.drain(60), st.loop.loop)
        health = health_pb2_grpc.HealthStub(st.channel())
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not drained.done()  # 239 tokens to go
        with pytest.raises(grpc.RpcError) as e:
            st.generate(prompt="new", max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(stream)
        assert [t for c in chunks for t in c.token_ids] == off["token_ids"]
        drained.result(timeout=30)
        assert st.orchestrator.servicer.active == 0
        st.wait_no_sessions()
    finally:
        st.close()


def test_each_request_creates_one_session_on_one_target_replica(cluster: Cluster) -> None:
    """Nothing fails: each request's prefill and every verify go to one
    replica (a verify anywhere else would be NOT_FOUND and show as a rebuild
    and a second session), and bounded-load hashing uses both replicas."""
    t0, t1 = cluster.targets
    before = {t.address: t.calls("prefill") for t in (t0, t1)}
    orch_before = cluster.orch_metrics()
    results = run_all(cluster.stack, PROMPTS)
    assert_exact(cluster, PROMPTS, results)
    assert all(r["stats"].target_rebuilds == 0 and r["stats"].draft_failures == 0 for r in results)
    assert all(r["stats"].draft_tokens > 0 for r in results)
    orch_after = cluster.orch_metrics()
    per_replica = {t.address: t.calls("prefill") - before[t.address] for t in (t0, t1)}
    assert sum(per_replica.values()) == N_REQUESTS  # exactly one session per request
    assert all(n > 0 for n in per_replica.values()), per_replica  # both replicas used
    for addr, n in per_replica.items():  # the orchestrator's per-replica counter agrees with the replica's
        assert created(orch_after, addr) - created(orch_before, addr) == n
    for t in (t0, t1):  # every session released
        assert t.metrics()[("specdec_target_active_sessions", ())] == 0


def test_added_draft_replica_receives_proposals(cluster: Cluster) -> None:
    d2 = cluster.start_draft()
    cluster.drafts.append(d2)
    d2.wait_serving()
    assert d2.calls("propose") == 0
    cluster.set_drafts(cluster.drafts)
    cluster.wait_draft_available(d2.address)
    results = run_all(cluster.stack, PROMPTS)
    assert_exact(cluster, PROMPTS, results)
    assert d2.calls("propose") > 0
    assert all(d.calls("propose") > 0 for d in cluster.drafts)
    m = cluster.orch_metrics()
    assert m[("specdec_orchestrator_draft_sessions_created_total", (("replica", d2.address),))] > 0
    assert m[("specdec_orchestrator_upstream_replicas", (("service", "draft"), ("state", "available")))] == 3


def test_killed_target_and_draft_replicas_lose_no_request(cluster: Cluster) -> None:
    """SIGKILL one target and one draft while 12 greedy streams run: every
    stream completes with the target-only output; the sessions on the dead
    target are rebuilt on the other one from the orchestrator's tokens."""
    dead_t, dead_d = cluster.targets[0], cluster.drafts[0]

    def kill_both() -> None:
        dead_t.kill()
        dead_d.kill()

    results = run_all(cluster.stack, PROMPTS, on_started=kill_both)
    assert_exact(cluster, PROMPTS, results)
    rebuilt = [r for r in results if r["stats"].target_rebuilds]
    assert rebuilt, "no stream was on the killed target mid-stream"
    assert all(r["stats"].target_rebuilds == 1 for r in rebuilt)  # one rebuild, on the surviving replica
    m = cluster.orch_metrics()
    assert m[("specdec_orchestrator_upstream_failures_total", (("replica", dead_t.address), ("service", "target")))] >= 1
    # the survivors carry on; later requests run with speculation, exactly
    cluster.targets.remove(dead_t)
    cluster.drafts.remove(dead_d)
    cluster.set_drafts(cluster.drafts)
    again = run_all(cluster.stack, PROMPTS[:4])
    assert_exact(cluster, PROMPTS[:4], again)
    assert all(r["stats"].target_rebuilds == 0 and r["stats"].draft_tokens > 0 for r in again)


def test_drained_target_finishes_its_streams_before_exiting(cluster: Cluster) -> None:
    """SIGTERM the last target while streams run on it: health goes
    NOT_SERVING and new sessions are refused, but its open sessions keep
    being verified until released (no rebuilds), then it exits cleanly."""
    (last,) = cluster.targets
    prompts = PROMPTS[:6]
    verifies_before = last.calls("verify")
    at_sigterm: list[float] = []

    def sigterm() -> None:
        last.proc.send_signal(signal.SIGTERM)
        at_sigterm.append(last.calls("verify"))  # counted after the signal: an upper bound

    results = run_all(cluster.stack, prompts, on_started=sigterm)
    assert_exact(cluster, prompts, results)
    assert all(r["stats"].target_rebuilds == 0 for r in results)
    rounds = sum(r["stats"].rounds for r in results)
    assert rounds - (at_sigterm[0] - verifies_before) > 0, "no round was verified during the drain"
    assert last.proc.wait(timeout=60) == 0
    # no target left: a new request ends with UNAVAILABLE, the orchestrator stays up
    with pytest.raises(grpc.RpcError) as e:
        cluster.stack.generate(prompt="after", max_new_tokens=4, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "target" in (e.value.details() or "")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(cluster.stack.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert cluster.orch.servicer.active == 0

