"""The draft gRPC service on 127.0.0.1 (port 0) with tiny real models:
health, model info, propose/release, status codes, limits, no session leaks."""

from __future__ import annotations

import asyncio
import threading
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from draft_service.config import DrafterSpec, DraftServiceConfig
from draft_service.drafter import OnnxDrafter
from draft_service.onnx_model import OnnxCausalLM
from draft_service.server import DraftServer, start
from orchestrator.clients import GrpcDraftClient
from specdec.draft_chain import ChainToken
from specdec.sampling import SamplingConfig
from specdec.tokenization import tokenizer_fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx


def _config(tiny_models: TinyModels, tiny_onnx: TinyOnnx, **overrides: Any) -> DraftServiceConfig:
    cfg = DraftServiceConfig(
        drafters=[
            DrafterSpec(name="tiny", model=str(tiny_models.draft), precision="fp32"),
            DrafterSpec(name="other", model=str(tiny_models.uncorrelated), precision="fp32"),
        ],
        host="127.0.0.1",
        port=0,
        intra_op_threads=1,
        cache_dir=tiny_onnx.cache_dir,
        max_sessions=8,
    )
    return dataclasses.replace(cfg, **overrides)


@contextlib.asynccontextmanager
async def serve(
    config: DraftServiceConfig,
) -> AsyncIterator[tuple[DraftServer, draft_pb2_grpc.DraftStub, grpc.aio.Channel]]:
    server = await start(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, draft_pb2_grpc.DraftStub(channel), channel
    finally:
        await channel.close()
        await server.stop(0)


def preq(sid: str, new: list[int], num_tokens: int, base_len: int = 0) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(session_id=sid, base_len=base_len, new_token_ids=new, num_tokens=num_tokens)


async def _code(coro: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    return e.value.code()


def test_health_info_propose_release(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (server, stub, channel):
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "specdec.v1.Draft"):
                r = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert r.status == health_pb2.HealthCheckResponse.SERVING

            info = await stub.GetModelInfo(common_pb2.ModelInfoRequest())
            fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_models.draft)))
            assert (info.model_name, info.vocab_size, list(info.eos_token_ids)) == ("draft", 34, [0])
            assert (info.tokenizer_fingerprint, info.dtype, info.device, info.max_context_tokens) == (
                fp,
                "fp32",
                "cpu",
                512,
            )

            created = await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())
            assert created.drafter == "tiny" and len(created.session_id) == 32
            sid = created.session_id
            prompt = [5, 6, 7, 8, 9]
            r = await stub.Propose(preq(sid, prompt, 4))
            assert len(r.token_ids) == len(r.probs) == 4 and r.committed_len == 5
            assert r.timings.compute_ms > 0 and r.timings.queue_ms >= 0
            for x, q in zip(r.token_ids, r.probs):  # greedy: one-hot q
                assert list(q.token_ids) == [x] and list(q.probs) == [1.0]
            # same as the drafter in-process
            local = OnnxDrafter("x", OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1))
            want = local.propose(local.new_state(), prompt, 4, SamplingConfig(), np.random.default_rng())
            assert list(r.token_ids) == want.token_ids
            # next round: two drafted tokens accepted + a different recovered token
            nxt = [r.token_ids[0], r.token_ids[1], (r.token_ids[2] + 1) % 34]
            r2 = await stub.Propose(preq(sid, nxt, 3, base_len=5))
            want2 = local.propose(local.new_state(), prompt + nxt, 3, SamplingConfig(), np.random.default_rng())
            assert list(r2.token_ids) == want2.token_ids and r2.committed_len == 8

            # the other drafter, by name
            other = await stub.CreateSession(draft_pb2.CreateDraftSessionRequest(drafter="other"))
            assert other.drafter == "other"
            assert len(server.sessions) == 2

            rel = await stub.Release(common_pb2.ReleaseRequest(session_id=sid))
            assert rel.released
            assert not (await stub.Release(common_pb2.ReleaseRequest(session_id=sid))).released  # idempotent
            req = draft_pb2.ProposeRequest(session_id=sid, base_len=0, new_token_ids=[1], num_tokens=1)
            assert await _code(stub.Propose(req)) == grpc.StatusCode.NOT_FOUND
            await stub.Release(common_pb2.ReleaseRequest(session_id=other.session_id))
            assert len(server.sessions) == 0

    asyncio.run(main())


def test_status_codes(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx, max_span=16)) as (server, stub, _):
            sid = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            await stub.Propose(draft_pb2.ProposeRequest(session_id=sid, new_token_ids=[1, 2, 3], num_tokens=2))

            def propose(**kw: Any) -> Any:
                kw.setdefault("session_id", sid)
                kw.setdefault("num_tokens", 2)
                return stub.Propose(draft_pb2.ProposeRequest(**kw))

            invalid = grpc.StatusCode.INVALID_ARGUMENT
            assert await _code(propose(base_len=3, new_token_ids=[34])) == invalid  # id == vocab
            assert await _code(propose(base_len=3, new_token_ids=[-5])) == invalid
            assert await _code(propose(base_len=3, new_token_ids=[1], num_tokens=0)) == invalid
            assert await _code(propose(base_len=3, new_token_ids=[1], num_tokens=17)) == invalid
            assert await _code(propose(base_len=0, new_token_ids=[])) == invalid  # empty context
            assert await _code(propose(base_len=4, new_token_ids=[1])) == grpc.StatusCode.FAILED_PRECONDITION
            assert await _code(propose(session_id="feed", new_token_ids=[1])) == grpc.StatusCode.NOT_FOUND
            # a failed call left the session usable, with its 3 committed tokens
            ok = await propose(base_len=3, new_token_ids=[4], num_tokens=16)
            assert ok.committed_len == 4 and len(ok.token_ids) == 16

            bad_sampling = draft_pb2.CreateDraftSessionRequest(sampling=common_pb2.SamplingParams(temperature=-1))
            assert await _code(stub.CreateSession(bad_sampling)) == invalid
            assert await _code(stub.CreateSession(draft_pb2.CreateDraftSessionRequest(drafter="nope"))) == invalid
            assert len(server.sessions) == 1

    asyncio.run(main())


def test_session_limit(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx, max_sessions=2)) as (server, stub, _):
            a = await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())
            await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())
            code = await _code(stub.CreateSession(draft_pb2.CreateDraftSessionRequest()))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            await stub.Release(common_pb2.ReleaseRequest(session_id=a.session_id))
            await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())
            assert len(server.sessions) == 2

    asyncio.run(main())


def test_seeded_sampling_is_reproducible(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (_, stub, _ch):
            sampling = common_pb2.SamplingParams(temperature=0.9, top_k=8, seed=1234)
            runs = []
            for _ in range(2):
                sid = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest(sampling=sampling))).session_id
                r1 = await stub.Propose(preq(sid, [3, 4, 5], 6))
                r2 = await stub.Propose(preq(sid, list(r1.token_ids[:2]), 6, base_len=3))
                runs.append([(list(r.token_ids), [(list(q.token_ids), list(q.probs)) for q in r.probs])
                             for r in (r1, r2)])
                for r in (r1, r2):
                    for x, q in zip(r.token_ids, r.probs):
                        assert x in q.token_ids and len(q.token_ids) <= 8
                        assert abs(sum(q.probs) - 1.0) < 1e-5
            assert runs[0] == runs[1]

    asyncio.run(main())


def test_concurrent_clients_leave_no_sessions_and_idle_ones_are_reaped(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx
) -> None:
    async def client(stub: draft_pb2_grpc.DraftStub, seed: int) -> None:
        rng = np.random.default_rng(seed)
        sid = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
        try:
            committed = [int(x) for x in rng.integers(1, 34, 6)]
            r = await stub.Propose(draft_pb2.ProposeRequest(session_id=sid, new_token_ids=committed, num_tokens=4))
            for _ in range(5):
                k = int(rng.integers(0, len(r.token_ids) + 1))
                new = list(r.token_ids[:k]) + [int(rng.integers(1, 34))]
                r = await stub.Propose(
                    draft_pb2.ProposeRequest(session_id=sid, base_len=len(committed), new_token_ids=new, num_tokens=4)
                )
                committed += new
                assert r.committed_len == len(committed)
        finally:
            await stub.Release(common_pb2.ReleaseRequest(session_id=sid))

    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx, session_ttl_s=1.0)) as (server, stub, _):
            await asyncio.gather(*(client(stub, i) for i in range(8)))
            assert len(server.sessions) == 0 and server.sessions.created_total == 8
            # an abandoned session is reaped after the TTL
            sid = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            assert len(server.sessions) == 1
            for _ in range(40):
                await asyncio.sleep(0.1)
                if len(server.sessions) == 0:
                    break
            assert len(server.sessions) == 0
            req = draft_pb2.ProposeRequest(session_id=sid, new_token_ids=[1], num_tokens=1)
            assert await _code(stub.Propose(req)) == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_not_serving_and_unavailable_while_loading(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import threading

    import draft_service.server as server_mod

    release = threading.Event()
    real_load = server_mod.load_drafter

    def slow_load(*args: Any) -> Any:
        release.wait(30)
        return real_load(*args)

    monkeypatch.setattr(server_mod, "load_drafter", slow_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        task = asyncio.create_task(start(_config(tiny_models, tiny_onnx, port=port)))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = draft_pb2_grpc.DraftStub(channel)
            status = None
            for _ in range(100):
                try:
                    status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            code = await _code(stub.GetModelInfo(common_pb2.ModelInfoRequest()))
            assert code == grpc.StatusCode.UNAVAILABLE
            code = await _code(stub.CreateSession(draft_pb2.CreateDraftSessionRequest()))
            assert code == grpc.StatusCode.UNAVAILABLE
            release.set()
            server = await task
            try:
                r = await health.Check(health_pb2.HealthCheckRequest())
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                await server.stop(0)

    asyncio.run(main())


def test_full_queue_is_resource_exhausted(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    """With the model worker busy and max_queue calls pending, the next
    Propose answers RESOURCE_EXHAUSTED; the queued calls then complete and
    the service stays healthy (the orchestrator's round runs target-only)."""
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx, max_queue=2)) as (server, stub, channel):
            gate = threading.Event()
            blocker = asyncio.ensure_future(server.worker.run(gate.wait, 30))  # holds the model thread
            sid = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            sid2 = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            queued = asyncio.ensure_future(stub.Propose(preq(sid, [1, 2, 3], 4)))
            while server.worker.pending < 2:
                await asyncio.sleep(0.01)
            code = await _code(stub.Propose(preq(sid2, [1, 2, 3], 4)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            gate.set()
            await blocker
            assert len((await queued).token_ids) == 4
            assert len((await stub.Propose(preq(sid2, [1, 2, 3], 4))).token_ids) == 4
            r = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert r.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(main())


# ------------------------------------------------------------ Session stream
def _open(tokens: list[int], until: int, drafter: str = "") -> draft_pb2.DraftSessionRequest:
    return draft_pb2.DraftSessionRequest(open=draft_pb2.DraftOpen(token_ids=tokens, draft_until=until, drafter=drafter))


def _commit(version: int, tokens: list[int], until: int) -> draft_pb2.DraftSessionRequest:
    return draft_pb2.DraftSessionRequest(commit=draft_pb2.DraftCommit(version=version, token_ids=tokens,
                                                                      draft_until=until))


def test_session_stream_drafts_within_credit_keeps_a_confirmed_chain_and_ends_cleanly(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx
) -> None:
    """A Session stream drafts exactly what Propose would (greedy), never past
    its credit, goes on under the same version when a commit confirms its
    chain, restarts under the commit's version otherwise, and releases its
    session when the caller half-closes or cancels."""
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (server, stub, _):
            local = OnnxDrafter("x", OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1))
            prompt = [5, 6, 7, 8, 9]
            want = local.propose(local.new_state(), prompt, 6, SamplingConfig(), np.random.default_rng()).token_ids
            call = stub.Session()
            await call.write(_open(prompt, until=5 + 4))
            opened = await call.read()
            assert opened.opened.drafter == "tiny" and len(server.sessions) == 1
            toks = [(await call.read()).token for _ in range(4)]
            assert [(t.position, t.version) for t in toks] == [(5, 0), (6, 0), (7, 0), (8, 0)]
            assert [t.token_id for t in toks] == want[:4]
            assert all(list(t.prob.token_ids) == [t.token_id] and t.compute_ms > 0 for t in toks)
            # no more credit: nothing comes until a commit; the first two are accepted + a "bonus"
            # equal to the third: the chain goes on under version 0 and drafts positions 9 and 10
            await call.write(_commit(1, want[:3], until=8 + 3))
            more = [(await call.read()).token for _ in range(2)]
            assert [(t.position, t.version) for t in more] == [(9, 0), (10, 0)]
            assert [t.token_id for t in more] == want[4:6]
            # a correction that is not the chain's: a new chain under version 2 at position 10
            await call.write(_commit(2, [want[3], (want[4] + 1) % 34], until=10 + 1))
            restart = (await call.read()).token
            assert (restart.position, restart.version) == (10, 2)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert (await call.code()) == grpc.StatusCode.OK
            for _ in range(50):
                if len(server.sessions) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(server.sessions) == 0
            # cancelling releases it too
            call = stub.Session()
            await call.write(_open(prompt, until=6))
            await call.read()
            assert len(server.sessions) == 1
            call.cancel()
            for _ in range(100):
                if len(server.sessions) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(server.sessions) == 0

    asyncio.run(main())


async def _events(stream: Any, until: int | None) -> list[tuple[str, int, int, int]]:
    """(kind, position, version, token or 0) for every event until a token at
    position ``until - 1`` or a pause (None: a pause only)."""
    out: list[tuple[str, int, int, int]] = []
    while True:
        await stream.wait(10.0)
        for ev in stream.ready():
            if isinstance(ev, ChainToken):
                out.append(("token", ev.position, ev.version, ev.token_id))
                assert ev.q[0].tolist() == [ev.token_id] and ev.q[1].tolist() == [1.0]
                if until is not None and ev.position == until - 1:
                    return out
            else:
                out.append((f"paused:{ev.reason}", ev.position, ev.version, 0))
                return out


@pytest.mark.parametrize("drafter", ["tiny", "lookup"])
def test_session_stream_batches_carry_the_same_events_as_single_messages(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, drafter: str
) -> None:
    """A caller that sets ``batch_events`` gets the same tokens, positions,
    versions, q and pauses as one that reads one event per message (as a
    caller predating batches does). Prompt lookup drafts a whole span in one
    step, and it arrives as one ``batch`` message."""
    cfg = _config(tiny_models, tiny_onnx)
    cfg = dataclasses.replace(cfg, drafters=cfg.drafters + [DrafterSpec(name="lookup", kind="prompt-lookup")])
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # lookup: ...5 6 7 -> 8 9 10 11 5 6 7 8

    async def run(channel: grpc.aio.Channel, batch: bool) -> list[tuple[str, int, int, int]]:
        client = GrpcDraftClient(channel, batch_events=batch)
        stream = await client.open_stream(SamplingConfig(), drafter, 0, prompt, len(prompt) + 4, 0.0, 10.0)
        try:
            got = await _events(stream, len(prompt) + 4)
            # two tokens confirmed, the third corrected to one never seen: a new
            # chain under version 1 (prompt lookup finds no match: a pause)
            drafted = [t for kind, _, _, t in got if kind == "token"]
            await stream.commit(1, drafted[:2] + [33], len(prompt) + 3 + 3, 0.0)
            more = await _events(stream, len(prompt) + 3 + 3)
            # one more committed token, and a confidence stop a model drafter
            # always hits past the committed end (prompt lookup's hits have 1.0)
            chain = [t for kind, _, _, t in more if kind == "token"]
            await stream.commit(2, chain[:1] or [5], len(prompt) + 4 + 3, 1.0)
            return got + more + await _events(stream, len(prompt) + 4 + 3 if drafter == "lookup" else None)
        finally:
            await stream.close()

    async def main() -> None:
        async with serve(cfg) as (server, stub, channel):
            single = await run(channel, False)
            batched = await run(channel, True)
            assert batched == single
            kinds = [kind for kind, _, _, _ in single]
            if drafter == "lookup":
                assert [t for _, _, _, t in single[:4]] == [8, 9, 10, 11]
                assert kinds[4] == "paused:no_draft" and single[4][1:3] == (len(prompt) + 3, 1)
                assert single[5:] == [("token", len(prompt) + 4 + i, 2, t) for i, t in enumerate([6, 7, 8])]
            else:
                assert [v for kind, _, v, _ in single if kind == "token"] == [0] * 4 + [1] * 3 + [1]
                assert kinds[-1] == "paused:confidence"
                # the whole span is one message on the wire
                call = stub.Session()
                await call.write(draft_pb2.DraftSessionRequest(open=draft_pb2.DraftOpen(
                    token_ids=prompt, draft_until=len(prompt) + 4, drafter="lookup", batch_events=True)))
                assert (await call.read()).WhichOneof("kind") == "opened"
                ev = await call.read()
                assert ev.WhichOneof("kind") == "batch"
                assert [t.token_id for t in ev.batch.tokens] == [8, 9, 10, 11]
                assert [t.position for t in ev.batch.tokens] == list(range(len(prompt), len(prompt) + 4))
                call.cancel()

    asyncio.run(main())


@pytest.mark.parametrize(
    "messages,match",
    [
        ([_commit(1, [1], 3)], "first message"),
        ([_open([], 3)], "at least one token"),
        ([_open([1, 2], 3, drafter="nope")], "unknown drafter"),
        ([_open([1, 2], 3), _commit(2, [3], 5)], "out of order"),
        ([_open([1, 2], 3), _commit(1, [99], 5)], "outside"),
        ([_open([1, 2], 3), _open([1, 2], 3)], "only the first message"),
    ],
    ids=["commit-first", "empty", "unknown-drafter", "version", "vocab", "open-twice"],
)
def test_session_stream_bad_input_is_invalid_argument_and_leaks_nothing(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, messages: list[draft_pb2.DraftSessionRequest], match: str
) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx)) as (server, stub, _):
            call = stub.Session()
            for m in messages:
                await call.write(m)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while True:
                    if await call.read() is grpc.aio.EOF:
                        break
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert match in (e.value.details() or "")
            for _ in range(50):
                if len(server.sessions) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(server.sessions) == 0
            # the service still serves
            ok = stub.Session()
            await ok.write(_open([1, 2], 3))
            assert (await ok.read()).opened.session_id
            ok.cancel()

    asyncio.run(main())
