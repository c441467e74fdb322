"""The draft's chunked catch-up prefill (issue 26) with a tiny random-weight
float32 ONNX drafter: chunks draft exactly what one forward drafts, a long
catch-up runs a chunk per worker job so other sessions' calls run between
them (a real server on loopback), a cancelled or released call stops within
a chunk and frees the session, and the orchestrator's overlapped draft
prefill never holds back the target's first token."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest

from draft_service.config import DraftServiceConfig
from draft_service.drafter import OnnxDrafter
from draft_service.onnx_model import OnnxCausalLM
from draft_service.server import DraftServer
from draft_service.sessions import CatchUp, ProposeResult, SessionStore
from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.stack import make_request, start_stack
from tests.test_draft_kv import _config as kv_config
from tests.test_draft_kv import _propose, serve

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx

GREEDY = SamplingConfig()


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 34, size=n)]


@pytest.fixture(scope="module")
def model(tiny_onnx: TinyOnnx) -> OnnxCausalLM:
    return OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1)


def run_steps(store: SessionStore, sid: str, ctx: list[int], n: int, chunk: int) -> tuple[ProposeResult, list[CatchUp]]:
    """What the server does: Propose steps until the draft call ran."""
    chunks = []
    while True:
        out = store.propose(sid, 0, ctx, n, 0.0, chunk)
        if isinstance(out, ProposeResult):
            return out, chunks
        chunks.append(out)


@pytest.mark.parametrize("cfg", [GREEDY, SamplingConfig(temperature=1.0, seed=11)], ids=["greedy", "sampled"])
def test_chunked_catch_up_drafts_what_one_forward_drafts(model: OnnxCausalLM, cfg: SamplingConfig) -> None:
    whole, chunked = OnnxDrafter("tiny", model), OnnxDrafter("tiny", model, prefill_chunk_tokens=16)
    ctx = prompt(300, 1)
    a, b = SessionStore(4, 600, 8), SessionStore(4, 600, 8)
    ref = a.propose(a.create(whole, cfg).id, 0, ctx, 6).proposal  # one forward of 300 tokens
    assert isinstance(ref, type(ref)) and ref.fed_tokens == 300 + 5
    sid = b.create(chunked, cfg).id
    got, chunks = run_steps(b, sid, ctx, 6, 16)
    # 299 tokens before the last one: 18 chunks of 16 while more than 16 are left, the rest (11 + the last) drafts
    assert [c.fed for c in chunks] == [16] * 18
    assert [c.remaining for c in chunks] == [299 - 16 * k for k in range(1, 19)]
    assert got.proposal.fed_tokens == 11 + 1 + 5 and got.committed_len == 300
    assert got.proposal.token_ids == ref.token_ids
    for (gi, gp), (ri, rp) in zip(got.proposal.q, ref.q, strict=True):
        assert gi.tolist() == ri.tolist()
        np.testing.assert_allclose(gp, rp, rtol=1e-5, atol=1e-6)
    # the session goes on from the chunked state as from the whole one
    nxt = got.proposal.token_ids[:2]
    r2 = a.propose(a.create(whole, cfg).id, 0, ctx + nxt, 4).proposal if cfg.greedy else None
    g2, more = run_steps(b, sid, ctx + nxt, 4, 16)
    assert more == []  # a short delta needs no catch-up step
    if r2 is not None:
        assert g2.proposal.token_ids == r2.token_ids
    # negative control: a drafter with no chunk budget never returns a catch-up step
    c = SessionStore(4, 600, 8)
    out, none = run_steps(c, c.create(whole, cfg).id, ctx, 6, 0)
    assert none == [] and out.proposal.token_ids == ref.token_ids


def test_chunked_feed_inside_one_call_gives_the_same_logits(model: OnnxCausalLM) -> None:
    """DraftLoop._feed (the draft call's own prefill, when a caller sends a
    long delta without catch-up steps) in chunks of 7 against one forward."""
    ctx = prompt(200, 2)
    whole, chunked = OnnxDrafter("tiny", model), OnnxDrafter("tiny", model, prefill_chunk_tokens=7)
    s1, s2 = whole.new_state(), chunked.new_state()
    l1 = whole.loop._feed(s1, ctx)
    l2 = chunked.loop._feed(s2, ctx)
    assert s1.tokens == s2.tokens == ctx and s1.cache.length == s2.cache.length == 200
    np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-5)
    assert int(np.argmax(l2)) == int(np.argmax(l1))


# ------------------------------------------------------------------ server
def _config(tiny_models: TinyModels, tiny_onnx: TinyOnnx, **overrides: Any) -> DraftServiceConfig:
    """tests/test_draft_kv.py's tiny draft service, with catch-up chunks of 4 tokens."""
    return kv_config(tiny_models, tiny_onnx, **{"prefill_chunk_tokens": 4, **overrides})


async def _session(stub: draft_pb2_grpc.DraftStub) -> str:
    return str((await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id)


def _held(server: DraftServer, sid: str) -> int:
    return len(server.sessions.get(sid).state.tokens)


def test_a_long_catch_up_lets_other_sessions_propose_between_its_chunks(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, model: OnnxCausalLM
) -> None:
    long_ctx = prompt(480, 3)

    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (server, stub):
            a, b = await _session(stub), await _session(stub)
            await stub.Propose(_propose(b, prompt(6, 4), 2))
            long_call = asyncio.ensure_future(stub.Propose(_propose(a, long_ctx, 4)))
            while _held(server, a) == 0:  # its catch-up has started
                await asyncio.sleep(0.001)
            short = await stub.Propose(_propose(b, [5], 2, base=6))
            # the short call ran between two of the long one's chunks
            assert not long_call.done() and 0 < _held(server, a) < 479
            assert len(short.token_ids) == 2
            r = await long_call
            want = OnnxDrafter("tiny", model).propose(OnnxDrafter("tiny", model).new_state(), long_ctx, 4, GREEDY,
                                                      np.random.default_rng(0))
            assert list(r.token_ids) == want.token_ids and r.committed_len == 480
            assert r.timings.compute_ms > 0

    asyncio.run(main())


@pytest.mark.parametrize("how", ["cancel", "release"])
def test_a_call_given_up_during_its_catch_up_stops_within_a_chunk_and_frees_the_session(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, how: str
) -> None:
    long_ctx = prompt(480, 5)

    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (server, stub):
            sid = await _session(stub)
            call = stub.Propose(_propose(sid, long_ctx, 4))
            task = asyncio.ensure_future(call)
            while _held(server, sid) < 40:
                await asyncio.sleep(0.001)
            if how == "cancel":
                call.cancel()
            else:
                await stub.Release(common_pb2.ReleaseRequest(session_id=sid))
            with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)) as e:
                await task
            if how == "release":
                assert e.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
            while server.worker.pending:  # the chunk running when it was given up
                await asyncio.sleep(0.001)
            session = server.sessions._sessions.get(sid)
            if how == "cancel":  # the session stays (the caller may go on); what was fed is kept
                assert session is not None
                held = len(session.state.tokens)
                await asyncio.sleep(0.05)
                assert len(session.state.tokens) == held < 479  # no chunk ran after the cancel
                await stub.Release(common_pb2.ReleaseRequest(session_id=sid))
            assert len(server.sessions) == 0 and server.sessions.used_units == server.sessions.usage().used
            assert all(e.cache.length < 479 for e in server.sessions.prefixes.entries())  # type: ignore[union-attr]

    asyncio.run(main())


# ------------------------------------------------------------ orchestrator
def test_the_overlapped_draft_prefill_never_holds_back_the_first_token(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx
) -> None:
    """The draft's worker is held busy: the target's first token still comes
    (the overlapped prompt prefill waits behind it), rounds run target-only
    until the draft has the prompt, then speculate; the output is the
    target-only output (lossless)."""
    stack = start_stack(tiny_models.target, tiny_models.draft, tiny_onnx.cache_dir,
                        draft_overrides={"prefill_chunk_tokens": 16, "warmup": False},
                        orchestrator_overrides={"draft_prefill_overlap": "on"})
    try:
        assert stack.orchestrator.servicer.draft_prefill_overlap
        ids = prompt(300, 6)
        ref = stack.generate(prompt_token_ids=ids, mode="off", max_new_tokens=24)
        gate = threading.Event()
        blocker = asyncio.run_coroutine_threadsafe(stack.draft.worker.run(gate.wait, 60), stack.loop.loop)
        req = make_request(prompt_token_ids=ids, mode="fixed", gamma=4, max_new_tokens=24)
        first_at = None
        tokens: list[int] = []
        t0 = time.monotonic()
        stream = stack.orch_stub().Generate(req, timeout=120)
        for chunk in stream:
            if chunk.token_ids and first_at is None:
                first_at = time.monotonic() - t0
                assert not gate.is_set()  # the first token came while the draft could do nothing
                gate.set()
            tokens.extend(chunk.token_ids)
            last = chunk
        blocker.result(10)
        assert first_at is not None
        assert tokens == ref["token_ids"]
        assert last.stats.draft_tokens > 0  # the draft had the prompt and speculated later
        stack.wait_no_sessions()
    finally:
        stack.close()


def test_flags_reach_the_configs_through_specdec_up() -> None:
    from draft_service.cli import config_from_args as draft_config
    from orchestrator.cli import config_from_args as orch_config
    from specdec_app.cli import build_parser
    from specdec_app.up import child_commands

    a = build_parser().parse_args(["up", "--draft-prefill-chunk-tokens", "32", "--draft-prefill-overlap", "on"])
    cmds, _ = child_commands(a, "/tmp/cache")
    for name, conf, field, want in (("draft", draft_config, "prefill_chunk_tokens", 32),
                                    ("orchestrator", orch_config, "draft_prefill_overlap", "on")):
        served = build_parser().parse_args(cmds[name][cmds[name].index("serve"):])
        assert getattr(conf(served, 1), field) == want
    assert draft_config(build_parser().parse_args(["serve", "draft"]), 1).prefill_chunk_tokens == 128
    assert orch_config(build_parser().parse_args(["serve", "orchestrator"]), 1).draft_prefill_overlap == "auto"
