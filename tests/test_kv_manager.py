"""The target's KV manager (target_service/kv_manager.py): its budget in
bytes is the model's real K+V bytes per token, and an active session's
cache is never evicted for another session's growth: that Verify gets
RESOURCE_EXHAUSTED with the numbers, over gRPC on loopback, on the tiny
float32 target."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from specdec.errors import ResourceExhausted
from specdec.sampling import SamplingConfig
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine
from target_service.kv_manager import kv_bytes_per_token
from tests.stack import LoopThread


def test_bytes_per_token_is_the_caches_and_a_byte_budget_sets_the_token_budget(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """The estimate from the config equals what a real float32 cache holds
    per token (2 × layers × kv heads × head dim × 4 bytes); a budget in
    bytes is that many tokens, and a prompt past it is refused with both."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_models.target))
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert kv_bytes_per_token(cfg, "torch.float32") == expected
    assert kv_bytes_per_token(cfg, "bfloat16") == expected // 2
    engine = TargetEngine(tiny_models.target, dtype="float32", kv_budget_bytes=50 * expected)
    assert engine.kv_budget_tokens == 50 and engine.kv.budget_bytes == 50 * expected
    out = engine.prefill(list(range(1, 21)), SamplingConfig(), True)
    assert engine.kv.bytes_per_token == expected  # measured on the cache: unchanged
    assert engine.kv.used_tokens == 20 and engine.kv.used_bytes == 20 * expected
    engine.release(out.session_id)
    with pytest.raises(ResourceExhausted, match=rf"60 tokens exceeds .* budget of 50 tokens"):
        engine.prefill([1] * 60, SamplingConfig(), True)


@pytest.fixture
def target(tiny_models, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Any, target_pb2_grpc.TargetStub]]:  # type: ignore[no-untyped-def]
    from target_service.config import TargetServiceConfig
    from target_service.server import start

    loop = LoopThread()
    srv = loop.run(start(TargetServiceConfig(
        model=str(tiny_models.target), port=0, dtype="float32", backend="eager", calibrate=False, warmup=False,
        cache_dir=tmp_path, kv_budget_tokens=100, kv_protect_active_s=request.param)))
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        yield srv, target_pb2_grpc.TargetStub(ch)
    finally:
        ch.close()
        loop.run(srv.stop(0))
        loop.close()


def _verify(stub: target_pb2_grpc.TargetStub, r: Any, drafted: int) -> target_pb2.VerifyResponse:
    return stub.Verify(target_pb2.VerifyRequest(session_id=r.session_id, cache_len=r.cache_len,
                                                 new_token_ids=[r.next_token_id], draft_token_ids=[1] * drafted),
                       timeout=30)


@pytest.mark.parametrize("target", [10.0, 0.0], indirect=True, ids=["protect", "plain-lru"])
def test_an_active_session_is_never_evicted_for_anothers_growth(target) -> None:  # type: ignore[no-untyped-def]
    """Budget 100 tokens: A holds 60, B 30, both active. B's Verify of 1 +
    12 drafted tokens needs 13 more: RESOURCE_EXHAUSTED naming the budget
    and what holds it; A and B are intact, and a smaller Verify of B that
    fits goes through. Negative control (kv_protect_active_s 0, plain LRU):
    the same Verify evicts A, whose next Verify is NOT_FOUND."""
    srv, stub = target
    a = stub.Prefill(target_pb2.PrefillRequest(token_ids=[1 + i % 30 for i in range(60)], sample_next_token=True),
                     timeout=30)
    b = stub.Prefill(target_pb2.PrefillRequest(token_ids=[2 + i % 30 for i in range(30)], sample_next_token=True),
                     timeout=30)
    assert srv.engine.kv.used_tokens == 90
    if srv.engine.kv.protect_active_s:
        with pytest.raises(grpc.RpcError) as err:
            _verify(stub, b, 12)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        msg = err.value.details()
        assert "needs 13 KV tokens" in msg and "90 of this replica's budget of 100 tokens" in msg, msg
        assert "2 sessions active" in msg and "never evicted" in msg, msg
        assert srv.engine.num_sessions == 2 and srv.engine.evictions == 0
        assert _verify(stub, a, 0).cache_len == 61
        assert _verify(stub, b, 5).cache_len >= 31  # 61 + 36 fits
    else:
        assert _verify(stub, b, 12).cache_len >= 31
        assert srv.engine.evictions == 1
        with pytest.raises(grpc.RpcError) as err:
            _verify(stub, a, 0)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
