"""Verify over one ``VerifyStream`` call per session (orchestrator
``target_verify_stream``, on by default): the same tokens as unary Verify, the same status
codes for bad calls, the stream closed by Release and by any error, and
unary calls for a target that lacks the method. Real services on loopback,
tiny models."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Iterator

import pytest

from orchestrator.clients import GrpcTargetClient, make_channel
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from specdec.sampling import SamplingConfig
from tests.faults import FaultyProxy
from tests.stack import Stack, start_stack

PROMPTS = ["hello world", "the quick brown fox", "a, b, c."]


def _stack(tiny_models, onnx_cache_dir: Path, verify_stream: bool) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                    orchestrator_overrides={"target_verify_stream": verify_stream})
    yield s
    s.close()


@pytest.fixture(scope="module")
def streamed(tiny_models, onnx_cache_dir: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    yield from _stack(tiny_models, onnx_cache_dir, True)


@pytest.fixture(scope="module")
def unary(tiny_models, onnx_cache_dir: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    yield from _stack(tiny_models, onnx_cache_dir, False)


@pytest.mark.parametrize("draft_mode", ["unary", "run-ahead"])
def test_streamed_verify_gives_the_unary_tokens(streamed: Stack, unary: Stack, draft_mode: str) -> None:
    """Greedy: every mode equals target-only decoding through unary Verify.
    Seeded sampling (unary drafting, whose spans do not depend on timing):
    the same seed gives the same tokens over either transport."""
    opened = streamed.target.servicer.verify_streams  # type: ignore[union-attr]
    for prompt in PROMPTS:
        ref = unary.generate(prompt=prompt, mode="off", max_new_tokens=32)["token_ids"]
        for mode, gamma in (("off", 0), ("fixed", 4), ("auto", 0)):
            got = streamed.generate(prompt=prompt, mode=mode, gamma=gamma, max_new_tokens=32, draft_mode=draft_mode)
            assert got["token_ids"] == ref, (prompt, mode)
        if draft_mode == "unary":  # run-ahead spans depend on timing, so its seeded runs need not repeat
            kw = dict(prompt=prompt, mode="fixed", gamma=3, max_new_tokens=24, temperature=1.0, top_k=5, seed=7)
            assert streamed.generate(**kw)["token_ids"] == unary.generate(**kw)["token_ids"], prompt
    # one stream per request (each request's session), really used
    assert streamed.target.servicer.verify_streams - opened == (4 if draft_mode == "unary" else 3) * len(PROMPTS)  # type: ignore[union-attr]
    assert unary.target.servicer.verify_streams == 0  # type: ignore[union-attr]  # the reference ran unary
    streamed.assert_clean()


def test_bad_calls_on_the_stream_get_verifys_codes_and_close_it(streamed: Stack) -> None:
    """A wrong cache length, an unknown session and a drafted id outside the
    vocabulary answer FAILED_PRECONDITION, NOT_FOUND and INVALID_ARGUMENT, as
    unary Verify does; each error ends that session's stream, the next call
    opens a new one and is served; Release closes it and frees the session."""

    async def main() -> None:
        channel = make_channel(f"127.0.0.1:{streamed.target.port}", 1 << 22)
        client = GrpcTargetClient(channel, verify_stream=True)
        try:
            pre = await client.prefill([3, 4, 5], SamplingConfig(), True, 0, 10)
            sid = pre.session_id
            with pytest.raises(FailedPrecondition):
                await client.verify(sid, 99, [pre.next_token], [], [], 10)
            assert client.open_streams == 0
            with pytest.raises(NotFound):
                await client.verify("no-such-session", 3, [pre.next_token], [], [], 10)
            with pytest.raises(InvalidArgument):  # a drafted id outside the vocabulary
                await client.verify(sid, 3, [pre.next_token], [10**6], [], 10)
            assert client.open_streams == 0
            r1 = await client.verify(sid, 3, [pre.next_token], [], [], 10)
            r2 = await client.verify(sid, r1.cache_len, [r1.next_token], [], [], 10)
            assert (r1.cache_len, r2.cache_len) == (4, 5) and client.open_streams == 1
            await client.release(sid, 10)
            assert client.open_streams == 0
        finally:
            await channel.close()

    streamed.loop.run(main())
    streamed.wait_no_sessions()


def test_a_stalled_target_times_out_the_streamed_call(streamed: Stack) -> None:
    """No reply within the call's timeout: DEADLINE_EXCEEDED, and the stream
    is dropped (its late reply must never be read as the next round's)."""
    sched, gate = streamed.target.worker, threading.Event()

    async def main() -> None:
        channel = make_channel(f"127.0.0.1:{streamed.target.port}", 1 << 22)
        client = GrpcTargetClient(channel, verify_stream=True)
        try:
            pre = await client.prefill([3, 4, 5], SamplingConfig(), True, 0, 10)
            blocker = asyncio.ensure_future(sched.run(gate.wait, 10))
            with pytest.raises(DeadlineExceeded):
                await client.verify(pre.session_id, 3, [pre.next_token], [], [], 0.3)
            assert client.open_streams == 0
            gate.set()
            await blocker
            await client.release(pre.session_id, 10)
        finally:
            gate.set()
            await channel.close()

    streamed.loop.run(main())
    streamed.wait_no_sessions()


def test_a_target_without_verify_stream_gets_unary_calls(streamed: Stack) -> None:
    """An older target (no VerifyStream: UNIMPLEMENTED) is served by unary
    Verify, from that call on, with the same answers."""

    async def main() -> None:
        proxy = await FaultyProxy.start("specdec.v1.Target", f"127.0.0.1:{streamed.target.port}",
                                        omit=("VerifyStream",))
        channel = make_channel(proxy.address, 1 << 22)
        client = GrpcTargetClient(channel, verify_stream=True)
        try:
            pre = await client.prefill([3, 4, 5], SamplingConfig(), True, 0, 10)
            r = await client.verify(pre.session_id, 3, [pre.next_token], [], [], 10)
            r = await client.verify(pre.session_id, r.cache_len, [r.next_token], [], [], 10)
            assert r.cache_len == 5 and not client.verify_stream and client.open_streams == 0
            assert proxy.calls.get("Verify") == 2 and "VerifyStream" not in proxy.calls
            await client.release(pre.session_id, 10)
        finally:
            await channel.close()
            await proxy.server.stop(0)

    streamed.loop.run(main())
    streamed.wait_no_sessions()
