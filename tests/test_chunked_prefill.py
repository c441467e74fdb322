"""Chunked prefill (``prefill_chunk_tokens``) on the tiny float32 target:
the chunks compute what one forward computes, other sessions' verify rounds
run between two chunks of a long prompt (through the real gRPC server on
loopback, the scheduler's order recorded at its runner), and a caller that
goes away mid-prefill stops it within a chunk, leaving no session and no
KV reservation."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grpc
import pytest

from specdec.sampling import SamplingConfig
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.batching import Requeue
from target_service.calls import PrefillCall, PrefillChunk, PrefillOutcome, VerifyCall, VerifyOutcome
from target_service.engine import TargetEngine
from tests.stack import LoopThread

#: 200 tokens over the tiny vocabulary (ids 1..33), not periodic in a short window
LONG = [1 + (i * 7 + i // 5) % 33 for i in range(200)]


def greedy_run(engine: TargetEngine, prompt: list[int], n: int) -> tuple[list[int], list[list[float]]]:
    """The first ``n`` greedy tokens after ``prompt`` and, for each, its top-5 logprobs."""
    out = engine.prefill(prompt, SamplingConfig(), True, top_logprobs=5)
    assert out.next_token is not None
    tokens, tops, cache_len = [out.next_token], [[v for _, v in out.logprobs[0].top]], out.cache_len
    while len(tokens) < n:
        v = engine.verify(out.session_id, cache_len, [tokens[-1]], [], [])
        tokens.append(v.result.next_token)
        cache_len = v.cache_len
    engine.release(out.session_id)
    return tokens, tops


@pytest.fixture(scope="module")
def reference(tiny_models) -> tuple[list[int], list[list[float]]]:  # type: ignore[no-untyped-def]
    return greedy_run(TargetEngine(tiny_models.target, dtype="float32", prefill_chunk_tokens=0), LONG, 16)


@pytest.mark.parametrize("chunk", [1, 7, 64, 199])
def test_chunked_prefill_equals_one_forward(tiny_models, reference, chunk: int) -> None:  # type: ignore[no-untyped-def]
    """Greedy tokens after a 200-token prompt are identical prefilled in
    chunks of 1, 7, 64 or 199 tokens and in one forward, and the first
    token's top-5 logprobs agree to 1e-5.

    Numerics: float32 on CPU. The chunks see exactly the same keys, values
    and positions as one forward, but a matmul over fewer rows may sum in a
    different order, so the logits agree to rounding (about 1e-6 here), not
    bit for bit; greedy tokens are equal wherever the top two logits are
    further apart than that. Under bfloat16 the rounding is ~1e-2 and equal
    greedy output is not guaranteed (as for any change of batch shape)."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefill_chunk_tokens=chunk)
    tokens, tops = greedy_run(engine, LONG, 16)
    assert engine.prefill_chunks == math.ceil(len(LONG) / chunk)  # it did run in chunks
    assert tokens == reference[0]
    assert tops[0] == pytest.approx(reference[1][0], abs=1e-5)
    assert engine.num_sessions == 0 and engine.kv.reserved_tokens == 0


def test_a_chunk_batched_with_a_verify_row_keeps_both_results(tiny_models, reference) -> None:  # type: ignore[no-untyped-def]
    """The scheduler may put a chunk and another session's verify in one
    (padded) forward: the prompt's greedy output and the verify's token are
    those of running each alone."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefill_chunk_tokens=8)
    other = engine.prefill([3, 5, 7, 9, 11], SamplingConfig(), True)
    assert other.next_token is not None
    (part, info), (verified, _) = engine.run_batch([
        PrefillCall(LONG, SamplingConfig(), True),
        VerifyCall(other.session_id, other.cache_len, [other.next_token], [], []),
    ])
    assert info.batch_size == 2 and isinstance(part, Requeue) and isinstance(part.call, PrefillChunk)
    alone = TargetEngine(tiny_models.target, dtype="float32").prefill([3, 5, 7, 9, 11, other.next_token],
                                                                      SamplingConfig(), True)
    assert isinstance(verified, VerifyOutcome) and verified.result.next_token == alone.next_token
    while isinstance(part, Requeue):
        part, _ = engine.run_batch([part.call])[0]
    assert isinstance(part, PrefillOutcome) and part.next_token == reference[0][0]
    assert engine.num_sessions == 2 and engine.kv.reserved_tokens == 0


# ------------------------------------------------------------ through gRPC
class Server:
    def __init__(self, tiny_models: Any, tmp: Path, **overrides: Any) -> None:
        from target_service.config import TargetServiceConfig
        from target_service.server import start

        self.loop = LoopThread()
        cfg = TargetServiceConfig(model=str(tiny_models.target), port=0, dtype="float32", backend="eager",
                                  calibrate=False, warmup=False, cache_dir=tmp, **overrides)
        self.srv = self.loop.run(start(cfg))
        self.order: list[list[str]] = []  # per forward: the calls it served, "prefill" / "chunk" / "verify"
        run_batch = self.srv.engine.run_batch

        def recording(calls: Sequence[Any]) -> Any:
            self.order.append([type(c).__name__.removesuffix("Call").lower().replace("prefillchunk", "chunk")
                               for c in calls])
            return run_batch(calls)

        self.srv.worker.attach(recording)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.srv.port}"

    def gate(self) -> tuple[threading.Event, "asyncio.Future[Any]"]:
        """An exclusive job that holds the model thread until its event is set (call on the loop)."""
        ev = threading.Event()
        return ev, asyncio.ensure_future(self.srv.worker.run(ev.wait, 30))

    def close(self) -> None:
        self.loop.run(self.srv.stop(0))
        self.loop.close()


async def until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


@pytest.fixture
def server_factory(tiny_models, tmp_path: Path) -> Iterator[Callable[..., Server]]:  # type: ignore[no-untyped-def]
    made: list[Server] = []

    def make(**overrides: Any) -> Server:
        made.append(Server(tiny_models, tmp_path, **overrides))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("chunk,max_batch", [(8, 1), (8, 16), (0, 1)])
def test_verify_rounds_run_between_the_chunks_of_a_long_prompt(  # type: ignore[no-untyped-def]
    server_factory, reference, chunk: int, max_batch: int
) -> None:
    """A session's Verify that queues behind a 200-token Prefill is served
    after the prompt's first chunk, long before its last (25 chunks of 8),
    and the prompt's first token is the one-forward reference. Negative
    control: with chunking off (0) the Verify waits for the whole prefill."""
    # fixed chunks (prefill_share 0): the share rule, which cuts chunks while a session decodes, is tested below
    s = server_factory(prefill_chunk_tokens=chunk, max_batch_size=max_batch, prefill_share=0.0)

    async def main() -> tuple[Any, Any]:
        async with grpc.aio.insecure_channel(s.address) as ch:
            stub = target_pb2_grpc.TargetStub(ch)
            a = await stub.Prefill(target_pb2.PrefillRequest(token_ids=[3, 5, 7], sample_next_token=True), timeout=30)
            s.order.clear()
            ev, gate = s.gate()  # queue both calls while the model thread is held, in this order
            await until(lambda: s.srv.worker.pending == 1)
            long = asyncio.ensure_future(stub.Prefill(
                target_pb2.PrefillRequest(token_ids=LONG, sample_next_token=True), timeout=30))
            await until(lambda: s.srv.worker.pending == 2)
            verify = asyncio.ensure_future(stub.Verify(target_pb2.VerifyRequest(
                session_id=a.session_id, cache_len=a.cache_len, new_token_ids=[a.next_token_id]), timeout=30))
            await until(lambda: s.srv.worker.pending == 3)
            ev.set()
            await gate
            return await long, await verify

    long, verify = s.loop.run(main())
    assert verify.cache_len == 4 and long.cache_len == len(LONG)
    assert long.next_token_id == reference[0][0]
    served = [i for i, calls in enumerate(s.order) if "verify" in calls][0]
    last_prompt_part = max(i for i, calls in enumerate(s.order) if {"prefill", "chunk"} & set(calls))
    if chunk:
        assert sum(c.count("chunk") for c in s.order) == len(LONG) // chunk - 1
        assert served <= 1 < last_prompt_part  # after the first chunk (or with it), before the last
        if max_batch == 1:
            assert s.order[:3] == [["prefill"], ["verify"], ["chunk"]]
    else:
        assert s.order == [["prefill"], ["verify"]]  # the whole prompt first: the verify waited for it


@pytest.mark.parametrize("how", ["cancel", "deadline", "none"])
def test_a_caller_gone_mid_prefill_stops_it_within_a_chunk(server_factory, how: str) -> None:  # type: ignore[no-untyped-def]
    """A 200-token Prefill in chunks of 8 whose caller cancels (or whose
    deadline passes) after the first chunk: the next chunk does not run,
    the session count and the KV reservation go back to 0, and the caller
    gets CANCELLED / DEADLINE_EXCEEDED. Negative control ("none"): the same
    prefill left alone runs all 25 chunks and keeps its session."""
    s = server_factory(prefill_chunk_tokens=8, max_batch_size=1)
    engine, servicer = s.srv.engine, s.srv.servicer
    assert servicer is not None

    async def main() -> Any:
        async with grpc.aio.insecure_channel(s.address) as ch:
            stub = target_pb2_grpc.TargetStub(ch)
            ev1, gate1 = s.gate()
            await until(lambda: s.srv.worker.pending == 1)
            call = stub.Prefill(target_pb2.PrefillRequest(token_ids=LONG, sample_next_token=True),
                                timeout=1.0 if how == "deadline" else 30)
            task = asyncio.ensure_future(call)
            await until(lambda: s.srv.worker.pending == 2)
            ev2, gate2 = s.gate()  # the first chunk's next part queues behind this one
            await until(lambda: s.srv.worker.pending == 3)
            ev1.set()
            await until(lambda: engine.prefill_chunks == 1)
            assert engine.kv.reserved_tokens == len(LONG) and engine.num_sessions == 0  # mid-prefill
            if how == "cancel":
                call.cancel()
            if how != "none":
                await until(lambda: servicer.prefills_cancelled == 1)
            ev2.set()
            await gate1
            await gate2
            try:
                return await task
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                return e

    out = s.loop.run(main())
    deadline = time.monotonic() + 10
    while s.srv.worker.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv.reserved_tokens == 0
    if how == "none":
        assert out.cache_len == len(LONG) and engine.num_sessions == 1 and engine.prefill_chunks == len(LONG) // 8
        return
    assert engine.prefill_chunks == 1, "the prefill ran on after its caller left"
    assert engine.num_sessions == 0 and engine.kv.used_tokens == 0
    if how == "deadline":
        assert isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert isinstance(out, (asyncio.CancelledError, grpc.aio.AioRpcError))


def test_chunks_are_cut_to_a_share_of_the_co_tenants_step() -> None:
    """While another session decodes, a chunk costs about ``share`` of its
    decode steps, from the forward times measured so far (at least 4
    tokens); alone, or before anything was measured, it is the full size."""
    from target_service.chunking import ChunkSizer

    sizer = ChunkSizer(256, 1.5)
    assert sizer.size(True) == 256  # nothing measured yet
    sizer.observe(decode=True, prefill=False, tokens=1, ms=30.0)
    sizer.observe(decode=False, prefill=True, tokens=256, ms=1536.0)  # 6 ms a prompt token
    assert sizer.size(False) == 256
    assert sizer.size(True) == 7  # 1.5 × 30 ms / 6 ms
    sizer.observe(decode=False, prefill=True, tokens=7, ms=70.0)  # small chunks cost more per token
    assert sizer.size(True) == 5  # 45 ms / 8 ms
    sizer.observe(decode=False, prefill=True, tokens=5, ms=400.0)
    assert sizer.size(True) == 4  # never below 4
    assert ChunkSizer(256, 0.0).size(True) == 256 and ChunkSizer(0, 1.5).size(True) == 0


def test_a_long_prompt_takes_small_chunks_only_while_another_session_decodes(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """On the engine: with session A used within the last second, the next
    prompt's chunks are cut below --prefill-chunk-tokens; once A has been
    idle for a second, they are whole again. (On the tiny model a forward's
    fixed cost dominates, ~8 ms a step against ~0.2 ms a prompt token, so
    the share is set low enough for the cut to fall below 64.)"""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefill_chunk_tokens=64, prefill_share=0.3,
                          prefix_cache=False)
    a = engine.prefill(LONG[:40], SamplingConfig(), True)
    v = engine.verify(a.session_id, a.cache_len, [a.next_token], [], [])
    engine.verify(a.session_id, v.cache_len, [v.result.next_token], [], [])
    engine.prefill(LONG, SamplingConfig(), True)  # measures a chunk's cost per token
    assert engine.chunks.step_ms > 0 and engine.chunks.prefill_ms_per_token > 0
    engine.kv.get(a.session_id)  # A is in use
    cut = engine._chunk_tokens("new")
    assert 4 <= cut < 64, (cut, engine.chunks.step_ms, engine.chunks.prefill_ms_per_token)
    time.sleep(1.1)
    assert engine._chunk_tokens("new") == 64


def test_a_co_tenant_counts_as_decoding_for_a_few_forwards_however_slow_they_are(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """The window in which another session counts as decoding is 1 s, or 3
    forwards' time when forwards are slower (a contended or slow machine):
    a stream whose rounds come more than a second apart because each forward
    is slow keeps the chunks cut, instead of being starved by full ones."""
    from target_service.chunking import ChunkSizer

    sizer = ChunkSizer(256, 1.5)
    sizer.observe(decode=True, prefill=False, tokens=1, ms=300.0)
    assert sizer.active_window_s() == 1.0
    sizer.observe(decode=False, prefill=True, tokens=8, ms=2500.0)  # a slow chunk
    assert sizer.active_window_s() == 7.5
    engine = TargetEngine(tiny_models.target, dtype="float32", prefill_chunk_tokens=64, prefill_share=0.3,
                          prefix_cache=False)
    a = engine.prefill(LONG[:40], SamplingConfig(), True)
    v = engine.verify(a.session_id, a.cache_len, [a.next_token], [], [])
    engine.verify(a.session_id, v.cache_len, [v.result.next_token], [], [])
    engine.prefill(LONG, SamplingConfig(), True)
    engine.kv.get(a.session_id)
    time.sleep(1.1)  # A's last round is over a second old ...
    assert engine._chunk_tokens("new") == 64  # negative control: fast forwards, A counts as idle
    engine.kv.get(a.session_id)
    time.sleep(1.1)
    engine.chunks.last_ms = 1000.0  # ... but forwards now take a second each: A is still decoding
    assert 4 <= engine._chunk_tokens("new") < 64
