"""The target service calibrates its numerics before it turns SERVING, reports
them in GetModelInfo and /metrics, and the orchestrator's cost model starts
from the measured curve (real servers on loopback, tiny models)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, target_pb2_grpc
from target_service import calibration as cal
from target_service.config import TargetServiceConfig
from tests.stack import LoopThread, Stack, free_port, start_stack


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    yield st
    st.close()


def test_model_info_reports_the_chosen_numerics_and_curve(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as ch:
        info = target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
    assert info.dtype == "float32"  # the stack asks for float32; the backend is calibrated
    assert info.backend in ("eager", "packed")
    assert info.numerics_chosen_by in ("calibration", "flags")
    assert info.cpu_isa  # e.g. "AVX2 [avx2]"
    assert [p.tokens for p in info.forward_cost] == list(cal.CALIBRATION_KS)
    assert all(p.ms > 0 for p in info.forward_cost)
    pairs = {(p.dtype, p.backend): p for p in info.calibrated}
    assert (info.dtype, info.backend) in pairs
    chosen = pairs[(info.dtype, info.backend)]
    assert [(p.tokens, p.ms) for p in chosen.forward_cost] == [(p.tokens, p.ms) for p in info.forward_cost]
    # the chosen pair has the best score of those measured
    assert chosen.score_tokens_per_s == max(p.score_tokens_per_s for p in info.calibrated)


def test_the_measured_costs_reach_the_orchestrators_policy(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as ch:
        info = target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
    policies = stack.orchestrator.servicer.policies
    assert policies.verify_curve == {p.tokens: p.ms for p in info.forward_cost}
    drafter = stack.orchestrator.servicer.default_drafter
    assert policies.draft_token_ms.get(drafter, 0.0) > 0.0
    # a fresh request's cost model starts there, before any round was observed
    policy = policies.make("auto", 0, "never-used-drafter")
    assert policy.costs.verify_ms(1) == pytest.approx(info.forward_cost[0].ms)


def test_target_metrics_export_the_curve(stack: Stack) -> None:
    from prometheus_client import generate_latest

    text = generate_latest(stack.target.servicer.metrics.registry).decode()
    assert 'specdec_target_forward_cost_ms{backend="' in text
    assert 'tokens="16"' in text
    assert "specdec_target_numerics_info{" in text


def test_calibration_runs_while_the_target_is_not_serving(tiny_models, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from target_service import server as target_server

    entered, release = threading.Event(), threading.Event()
    real = target_server.calibrate

    def gated(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(target_server, "calibrate", gated)
    loop = LoopThread()
    port = free_port()
    cfg = TargetServiceConfig(model=str(tiny_models.target), port=port, dtype="float32", cache_dir=tmp_path)
    fut = asyncio.run_coroutine_threadsafe(target_server.start(cfg), loop.loop)
    try:
        assert entered.wait(60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            release.set()
            server = fut.result(120)
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            info = target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=5)
            assert len(info.forward_cost) == len(cal.CALIBRATION_KS)
        loop.run(server.stop(0))
    finally:
        release.set()
        loop.close()

