"""Batched verification on the target: one forward pass for concurrent calls
from different sessions gives the same tokens and distributions as one call
at a time; admission control (bounded queue, KV budget) holds with batching.

Engine-level tests drive the real ``BatchScheduler`` + ``TargetEngine`` on the
tiny float32 target; end-to-end tests run real gRPC services on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from orchestrator.clients import GrpcTargetClient, make_channel
from specdec.sampling import SamplingConfig, process_logits
from specdec.v1 import target_pb2
from target_service.batching import BatchLimits, BatchScheduler, admissible_prefix
from target_service.calls import PrefillCall, VerifyCall
from target_service.engine import TargetEngine, _Row
from tests.stack import Stack, start_stack


# ----------------------------------------------------------- batch admission
@dataclass(frozen=True)
class _C:
    session_id: str
    past_len: int
    num_tokens: int


def test_admissible_prefix_limits() -> None:
    lim = BatchLimits(max_batch_size=3, max_batch_tokens=40, max_batch_kv_tokens=400, batch_window_ms=0)
    v = [_C(f"s{i}", 10, 5) for i in range(5)]
    assert admissible_prefix([], lim) == 0
    assert admissible_prefix(v, lim) == 3  # max_batch_size
    assert admissible_prefix([v[0], v[1], _C("s0", 15, 1), v[2]], lim) == 2  # one session once per batch
    assert admissible_prefix([_C("a", 0, 1), _C("b", 0, 1), _C("", 0, 12)], lim) == 2  # 3 x 12 padded, 14 real
    assert admissible_prefix([_C("", 0, 100), v[0]], lim) == 1  # a long prefill runs alone (always admitted)
    assert admissible_prefix([_C("", 0, 12), _C("", 0, 10), _C("", 0, 15)], lim) == 2  # 3 x 15 > 40 tokens
    assert admissible_prefix([v[0], _C("s9", 190, 5), v[1]], lim) == 2  # KV: 3 x 195 > 400
    assert admissible_prefix(v, BatchLimits(max_batch_size=1)) == 1


class _Info:
    def __init__(self, rows: int) -> None:
        self.batch_size, self.batch_tokens = rows, rows


def _lockstep_batches(regroup_ms: float, rounds: int, lag_ms: tuple[float, ...]) -> list[list[str]]:
    """Streams in lockstep: each session sends its next call ``lag_ms[i]``
    after its previous one returned (the orchestrator's per-stream work),
    through a scheduler whose forward pass takes 60 ms. Returns each
    forward's sessions."""
    batches: list[list[str]] = []

    def runner(calls: Any) -> list[tuple[Any, _Info]]:
        batches.append(sorted(c.session_id for c in calls))
        time.sleep(0.06)
        info = _Info(len(calls))
        return [(c.session_id, info) for c in calls]

    limits = BatchLimits(batch_window_ms=1.0, regroup_ms=regroup_ms, regroup_fraction=1.0)
    sched = BatchScheduler("test-regroup", limits=limits)
    sched.attach(runner)

    async def stream(i: int) -> None:
        for _ in range(rounds):
            await sched.submit(_C(f"s{i}", 10, 1))
            await asyncio.sleep(lag_ms[i] / 1e3)

    async def main() -> None:
        await asyncio.gather(*(stream(i) for i in range(len(lag_ms))))

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    return batches


def test_regroup_keeps_lockstep_streams_in_one_batch() -> None:
    """Four streams whose next calls arrive 0–30 ms apart: with regrouping,
    every forward after the first serves all four (without it the short
    window splits them, and they stay split)."""
    lags = (0.0, 10.0, 20.0, 30.0)
    batches = _lockstep_batches(regroup_ms=500.0, rounds=6, lag_ms=lags)
    everyone = ["s0", "s1", "s2", "s3"]
    assert batches[1:] == [everyone] * (len(batches) - 1), batches
    assert len(batches) <= 7  # 6 rounds, at most one extra forward while the streams first line up
    # A stream that ends is waited for once, at most the cap, then the rest go on.
    short = _lockstep_batches(regroup_ms=500.0, rounds=3, lag_ms=(0.0, 5.0))
    assert sum(len(b) for b in short) == 6 and ["s0", "s1"] in short


def test_a_lone_session_does_not_wait_for_the_batch_window() -> None:
    """With a 400 ms window: a session alone on the target is served at once
    (no other session could join its batch), a second active session makes
    the window wait for it again, and a released session stops counting."""
    batches: list[list[str]] = []

    def runner(calls: Any) -> list[tuple[Any, _Info]]:
        batches.append(sorted(c.session_id for c in calls))
        info = _Info(len(calls))
        return [(c.session_id, info) for c in calls]

    sched = BatchScheduler("test-lone", limits=BatchLimits(batch_window_ms=400.0, regroup_ms=0.0))
    sched.attach(runner)

    async def main() -> tuple[list[float], list[float]]:
        alone = [(await sched.submit(_C("a", 10, 1)))[1].queue_ms for _ in range(3)]
        first = asyncio.ensure_future(sched.submit(_C("b", 10, 1)))  # b is new: a is a peer, so b waits
        await asyncio.sleep(0.05)
        together = await asyncio.gather(first, sched.submit(_C("a", 10, 1)))
        sched.forget("b")
        sched.forget("a")
        return alone, [t.queue_ms for _, t in together] + [(await sched.submit(_C("a", 10, 1)))[1].queue_ms]

    try:
        alone, rest = asyncio.run(main())
    finally:
        sched.shutdown()
    assert max(alone) < 200, alone  # not the 400 ms window
    assert ["a", "b"] in batches  # the window still batches two active sessions
    assert rest[-1] < 200, rest  # both released: a new call is alone again


def test_batch_limits_validate_regroup() -> None:
    with pytest.raises(ValueError, match="regroup_ms"):
        BatchLimits(regroup_ms=-1.0).validate()
    with pytest.raises(ValueError, match="regroup_fraction"):
        BatchLimits(regroup_fraction=1.5).validate()
    lim = BatchLimits(regroup_ms=25.0, regroup_fraction=0.1)
    assert lim.regroup_wait_s(0.2) == pytest.approx(0.02)  # 10 % of a 200 ms pass
    assert lim.regroup_wait_s(1.0) == pytest.approx(0.025)  # capped
    assert BatchLimits(regroup_ms=0.0).regroup_wait_s(1.0) == 0.0


def test_cli_refuses_bad_batch_flags_before_starting() -> None:
    """`specdec serve target` and `specdec up` turn out-of-range batching
    flags into a one-line error naming the value, not a traceback from the
    scheduler at start-up."""
    from specdec_app.cli import build_parser
    from specdec_app.up import cmd_up
    from target_service.cli import config_from_args as target_config

    def config(*flags: str) -> Any:
        a = build_parser().parse_args(["serve", "target", *flags])
        return target_config(a, 0)

    assert config("--batch-regroup-ms", "10").batch_limits().regroup_ms == 10.0
    for flags in (["--batch-regroup-ms", "-5"], ["--batch-regroup-ms", "5000"], ["--batch-window-ms", "-1"],
                  ["--max-batch-size", "0"]):
        with pytest.raises(SystemExit, match=f"specdec: .*{flags[0]}"):  # names the flag typed
            config(*flags)
    with pytest.raises(SystemExit, match="specdec: --target-batch-regroup-ms must be in"):
        cmd_up(build_parser().parse_args(["up", "--target-batch-regroup-ms", "-1"]))


# ------------------------------------------------------ engine + scheduler
class RecordingEngine(TargetEngine):
    """The real engine; also keeps the processed target distribution each
    verified row was judged by, per session."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.probs: dict[str, list[torch.Tensor]] = {}

    def _finish_verify(self, row: _Row, rows: torch.Tensor) -> Any:
        cfg = row.sess.cfg
        p = torch.softmax(rows, -1) if cfg.greedy else process_logits(rows, cfg)
        self.probs.setdefault(row.sess.session_id, []).append(p)
        return super()._finish_verify(row, rows)


@pytest.fixture(scope="module")
def hf_model(tiny_models) -> Any:  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(str(tiny_models.target), dtype=torch.float32).eval()


def _draft(model: Any, committed: list[int], gamma: int, bad: int, vocab: int) -> list[int]:
    """The true greedy continuation with position ``bad`` corrupted (bad ≥ γ: all right)."""
    if gamma == 0:
        return []
    with torch.no_grad():
        cont = model.generate(torch.tensor([committed]), max_new_tokens=gamma, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(committed):].tolist()
    if bad < gamma:
        cont[bad] = (cont[bad] + 1) % vocab
    return cont


# (prompt, sampling, γ per round): mixed prompt lengths, spans 0..6, greedy and seeded sampling
SESSIONS = [
    ([1], SamplingConfig(), [2, 0, 6, 3, 1, 4]),
    ([3, 4, 5], SamplingConfig(), [6, 5, 0, 2, 4, 1]),
    (list(range(1, 20)), SamplingConfig(), [1, 3, 5, 0, 6, 2]),
    ([7] * 33, SamplingConfig(), [4, 4, 4, 4, 4, 4]),
    ([2, 9, 11, 5, 8], SamplingConfig(temperature=1.0, seed=11), [3, 1, 0, 5, 2, 6]),
    ([20, 21], SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, seed=5), [5, 2, 4, 0, 3, 1]),
]


def _run_sessions(engine: RecordingEngine, model: Any, batched: BatchScheduler | None) -> tuple[list[list[int]], list[str], list[int]]:
    """Decodes every session for len(γs) rounds; with ``batched``, each round's
    calls (and the prefills) are submitted together to the scheduler."""
    rng = np.random.default_rng(0)
    bads = [[int(rng.integers(0, 7)) for _ in g] for _, _, g in SESSIONS]
    committed = [list(p) for p, _, _ in SESSIONS]
    batch_sizes: list[int] = []

    async def gather(calls: list[Any]) -> list[Any]:
        assert batched is not None
        outs = await asyncio.gather(*(batched.submit(c) for c in calls))
        batch_sizes.extend(t.batch_size for _, t in outs)
        return [o for o, _ in outs]

    prefills = [PrefillCall(list(p), cfg, True) for p, cfg, _ in SESSIONS]
    if batched is None:
        pre = [engine.prefill(c.token_ids, c.cfg, True) for c in prefills]
    else:
        pre = asyncio.run(gather(prefills))
    sids = [o.session_id for o in pre]
    cache = [o.cache_len for o in pre]
    for c, o in zip(committed, pre):
        c.append(o.next_token)
    for r in range(len(SESSIONS[0][2])):
        calls = []
        for i, (_, cfg, gammas) in enumerate(SESSIONS):
            draft = _draft(model, committed[i], gammas[r], bads[i][r], engine.vocab_size)
            q = [None] * len(draft)  # one-hot q: a drafter without probabilities
            calls.append(VerifyCall(sids[i], cache[i], committed[i][cache[i]:], draft, q))
        if batched is None:
            outs = [engine.verify(c.session_id, c.cache_len, c.new_ids, c.draft_ids, c.draft_q) for c in calls]
        else:
            outs = asyncio.run(gather(calls))
        for i, (c, o) in enumerate(zip(calls, outs)):
            committed[i] += c.draft_ids[: o.result.num_accepted] + [o.result.next_token]
            cache[i] = o.cache_len
            assert cache[i] == len(committed[i]) - 1
    return committed, sids, batch_sizes


def test_batched_verification_equals_unbatched(tiny_models, hf_model: Any) -> None:  # type: ignore[no-untyped-def]
    """Six sessions (prompts of 1..33 tokens, spans of 0..6 drafted tokens,
    greedy and seeded sampling, partial acceptance) decoded one call at a
    time and with every round in one batched forward pass: identical tokens,
    and the target distributions agree to 1e-5."""
    engine = RecordingEngine(tiny_models.target, dtype="float32", max_sessions=64, kv_budget_tokens=10_000)
    ref, ref_sids, _ = _run_sessions(engine, hf_model, None)
    sched = BatchScheduler("test-batch", limits=BatchLimits(max_batch_size=8, batch_window_ms=200.0))
    sched.attach(engine.run_batch)
    try:
        got, sids, sizes = _run_sessions(engine, hf_model, sched)
    finally:
        sched.shutdown()
    assert got == ref
    n = len(SESSIONS)
    assert sizes[n:] == [n] * (len(sizes) - n)  # every verify round was one forward pass
    assert max(sizes[:n]) > 1  # prefills batched too (the 33-token prompt's padding splits them)
    accepted = [len(c) for c in got]
    assert len(set(accepted)) > 1  # different acceptance per row: the rollbacks differ
    for a, b in zip(ref_sids, sids):
        assert len(engine.probs[a]) == len(engine.probs[b])
        for pa, pb in zip(engine.probs[a], engine.probs[b]):
            torch.testing.assert_close(pb, pa, atol=1e-5, rtol=0)
    # the batched sessions' caches are exact: one more unbatched step agrees
    for a, b, c in zip(ref_sids, sids, got):
        va = engine.verify(a, len(c) - 1, [c[-1]], [], [])
        vb = engine.verify(b, len(c) - 1, [c[-1]], [], [])
        assert va.result.next_token == vb.result.next_token
        assert vb.logit_gaps == pytest.approx(va.logit_gaps, abs=1e-4)


def test_one_bad_call_does_not_fail_its_batch(tiny_models) -> None:  # type: ignore[no-untyped-def]
    engine = TargetEngine(tiny_models.target, dtype="float32", max_sessions=16, kv_budget_tokens=4096)
    a = engine.prefill([1, 2, 3], SamplingConfig(), True)
    b = engine.prefill([4, 5], SamplingConfig(), True)
    ref = engine.prefill([1, 2, 3], SamplingConfig(), True)
    expect = engine.verify(ref.session_id, 3, [a.next_token], [5, 6], [None, None])
    calls = [
        VerifyCall(a.session_id, 3, [a.next_token], [5, 6], [None, None]),
        VerifyCall(b.session_id, 99, [1], [], []),  # wrong cache_len
        VerifyCall("missing", 0, [1], [], []),
        VerifyCall(b.session_id, 2, [1], [engine.vocab_size], [None]),  # id out of range
        PrefillCall([], SamplingConfig(), True),
        VerifyCall(a.session_id, 3, [1], [], []),  # a second call of one session in one batch
    ]
    outs = engine.run_batch(calls)
    assert outs[0][0].result == expect.result and outs[0][0].cache_len == expect.cache_len
    assert [type(o).__name__ for o, _ in outs[1:]] == [
        "FailedPrecondition", "NotFound", "InvalidArgument", "InvalidArgument", "FailedPrecondition"]
    v = engine.verify(b.session_id, 2, [1], [], [])  # b untouched by its failed calls
    assert v.cache_len == 3


class OutOfMemoryEngine(TargetEngine):
    """The real engine with an injected out-of-memory failure: every batched
    forward, and single-row forwards once ``fail_single`` is set."""

    fail_single = False

    def _forward_batch(self, rows: Any) -> Any:
        raise RuntimeError("CUDA out of memory (injected)")

    def _forward(self, *a: Any) -> Any:
        if self.fail_single:
            raise RuntimeError("CUDA out of memory (injected)")
        return super()._forward(*a)


def test_failed_batched_forward_retries_rows_one_by_one(tiny_models) -> None:  # type: ignore[no-untyped-def]
    engine = OutOfMemoryEngine(tiny_models.target, dtype="float32", max_sessions=16, kv_budget_tokens=4096)
    ref = TargetEngine(tiny_models.target, dtype="float32", max_sessions=16, kv_budget_tokens=4096)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    pre = [o for o, _ in engine.run_batch([PrefillCall(p, SamplingConfig(), True) for p in prompts])]
    want = [ref.prefill(p, SamplingConfig(), True) for p in prompts]
    assert [o.next_token for o in pre] == [o.next_token for o in want]
    outs = engine.run_batch([VerifyCall(o.session_id, o.cache_len, [o.next_token], [3, 4], [None] * 2) for o in pre])
    expect = [ref.verify(o.session_id, o.cache_len, [o.next_token], [3, 4], [None] * 2) for o in want]
    assert [(o.result, o.cache_len) for o, _ in outs] == [(e.result, e.cache_len) for e in expect]
    assert [info.batch_size for _, info in outs] == [1, 1, 1]
    engine.fail_single = True  # now even one row cannot run: RESOURCE_EXHAUSTED, and the session is dropped
    (err, _), = engine.run_batch([VerifyCall(pre[0].session_id, outs[0][0].cache_len, [1], [], [])])
    assert type(err).__name__ == "ResourceExhausted"
    assert engine.num_sessions == 2


# ---------------------------------------------------------------- end to end
PROMPTS = ["hello world", "the quick brown fox", "a, b, c.", "zzz", "batching works", "one more prompt here!",
           "kv", "speculative decoding is lossless"]


@pytest.fixture(scope="module")
def batch_stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                    target_overrides={"max_batch_size": 16, "batch_window_ms": 5.0})
    yield s
    s.close()


def _concurrently(fn: Any, args: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(args)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(*args[i])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _forwards(stack: Stack, batched: str) -> float:
    assert stack.target.servicer is not None
    reg = stack.target.servicer.metrics.registry
    return reg.get_sample_value("specdec_target_forward_passes_total", {"batched": batched}) or 0.0


def test_concurrent_greedy_requests_on_a_batching_target_equal_off(batch_stack: Stack) -> None:
    """24 concurrent greedy requests (target-only, fixed γ and adaptive) on a
    batching target produce exactly the tokens of sequential target-only runs."""
    expected = {p: batch_stack.generate(prompt=p, mode="off", max_new_tokens=32)["token_ids"] for p in PROMPTS}
    before = _forwards(batch_stack, "yes")
    cases = [(p, m, g) for p in PROMPTS for m, g in (("off", 0), ("fixed", 3), ("auto", 0))]
    got = _concurrently(
        lambda p, m, g: batch_stack.generate(prompt=p, mode=m, gamma=g, max_new_tokens=32)["token_ids"], cases
    )
    for (p, _, _), ids in zip(cases, got):
        assert ids == expected[p], p
    assert _forwards(batch_stack, "yes") > before  # calls really shared forward passes
    batch_stack.wait_no_sessions()


def test_verify_reply_reports_the_batch(batch_stack: Stack) -> None:
    """Four Verify calls queued behind a busy model thread are served by one
    forward pass; each reply (through the orchestrator's client) says so."""
    loop, sched = batch_stack.loop, batch_stack.target.worker
    gate = threading.Event()

    async def main() -> list[Any]:
        channel = make_channel(f"127.0.0.1:{batch_stack.target.port}", 1 << 22)
        client = GrpcTargetClient(channel)
        pre = [await client.prefill([1 + i, 2, 3], SamplingConfig(), True, 0, 10) for i in range(4)]
        blocker = asyncio.ensure_future(sched.run(gate.wait, 10))
        while sched.pending < 1:
            await asyncio.sleep(0.01)
        calls = [asyncio.ensure_future(client.verify(p.session_id, 3, [p.next_token], [5] * (i + 1), [], 10))
                 for i, p in enumerate(pre)]
        while sched.pending < 5:
            await asyncio.sleep(0.01)
        gate.set()
        await blocker
        replies = await asyncio.gather(*calls)
        for p in pre:
            await client.release(p.session_id, 10)
        await channel.close()
        return replies

    replies = loop.run(main())
    assert [r.batch_size for r in replies] == [4] * 4
    assert [r.batch_tokens for r in replies] == [2 + 3 + 4 + 5] * 4
    assert all(r.cache_len >= 4 for r in replies)
    batch_stack.wait_no_sessions()


def test_small_kv_budget_evicts_and_rebuilds_with_batching(tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """8 concurrent requests on a batching target with a small KV budget
    (1800 tokens). Mid-stream, four 440-token prompts fill the budget, so the
    LRU eviction drops the streams' sessions; the orchestrator rebuilds them
    from its tokens (NOT_FOUND → Prefill) and every output equals its
    target-only reference."""
    budget = 1800
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                     target_overrides={"kv_budget_tokens": budget, "kv_protect_active_s": 0.0, "max_batch_size": 8,
                                       "batch_window_ms": 5.0})
    try:
        expected = {p: st.generate(prompt=p, mode="off", max_new_tokens=120)["token_ids"] for p in PROMPTS}
        engine, sched = st.target.engine, st.target.worker
        assert engine.evictions == 0  # one at a time fits

        def fill_budget() -> None:  # one job on the model thread, between two batches
            big = [engine.prefill([1 + i] * 440, SamplingConfig(), False).session_id for i in range(4)]
            for sid in big:
                engine.release(sid)

        def stuffer() -> None:
            deadline = time.monotonic() + 30
            while engine.num_sessions < len(PROMPTS) and time.monotonic() < deadline:
                time.sleep(0.002)
            st.loop.run(sched.run(fill_budget))

        filler = threading.Thread(target=stuffer)
        filler.start()
        got = _concurrently(lambda p: st.generate(prompt=p, mode="fixed", gamma=3, max_new_tokens=120),
                            [(p,) for p in PROMPTS])
        filler.join()
        for p, r in zip(PROMPTS, got):
            assert r["token_ids"] == expected[p], p
        rebuilds = sum(r["stats"].target_rebuilds for r in got)
        assert 4 <= rebuilds <= engine.evictions  # at most 40 of the 1800 tokens were left to the streams
        assert engine.cached_tokens <= budget
        st.wait_no_sessions()
    finally:
        st.close()


def test_full_target_queue_is_resource_exhausted_and_server_stays_healthy(tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    st = start_stack(tiny_models.target, None, onnx_cache_dir, target_overrides={"max_queue": 3})
    try:
        sched, t = st.target.worker, st.target_stub()
        gate = threading.Event()
        blocker = asyncio.run_coroutine_threadsafe(sched.run(gate.wait, 30), st.loop.loop)  # holds the model thread
        req = target_pb2.PrefillRequest(token_ids=[1, 2, 3], sample_next_token=True)
        waiting = [t.Prefill.future(req, timeout=30) for _ in range(2)]
        while sched.pending < 3:
            threading.Event().wait(0.01)
        with pytest.raises(grpc.RpcError) as e:
            t.Prefill(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # through the orchestrator too
            st.generate(prompt="full", mode="off", max_new_tokens=4, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.set()
        blocker.result(10)
        sids = [f.result().session_id for f in waiting]
        assert len(set(sids)) == 2
        for sid in sids:
            st.target.engine.release(sid)
        health = health_pb2_grpc.HealthStub(st.channel(f"127.0.0.1:{st.target.port}"))
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        assert len(st.generate(prompt="ok", mode="off", max_new_tokens=5)["token_ids"]) == 5
        st.wait_no_sessions()
    finally:
        st.close()
