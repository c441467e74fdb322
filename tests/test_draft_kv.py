"""The draft's KV budget and prefix cache (issue 26) with a tiny random-weight
ONNX drafter: eviction order, RESOURCE_EXHAUSTED with the numbers from a real
server on loopback, prefix hits that skip prefill and draft exactly what a
cold session drafts, entries left by Release and by a stream's end."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest

from draft_service.config import DrafterSpec, DraftServiceConfig
from draft_service.draft_kv import KVBudget, PrefixCache
from draft_service.drafter import OnnxDrafter
from draft_service.onnx_model import OnnxCausalLM
from draft_service.prompt_lookup import PromptLookupDrafter
from draft_service.server import DraftServer, start
from draft_service.sessions import SessionStore
from specdec.errors import NotFound, ResourceExhausted
from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

from tests.test_drafters_e2e import multi_stack, tli_models  # noqa: F401  (fixtures)

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx
    from tests.stack import Stack
    from tests.test_drafters_e2e import TliModels

GREEDY = SamplingConfig()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 34, size=n)]


@pytest.fixture(scope="module")
def drafter(tiny_onnx: TinyOnnx) -> OnnxDrafter:
    return OnnxDrafter("tiny", OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1))


def store(budget: int, clock: Clock, prefixes: bool = True, protect: float = 10.0) -> SessionStore:
    return SessionStore(16, 600, 8, clock, budget=KVBudget(budget), protect_active_s=protect,
                        prefixes=PrefixCache(8) if prefixes else None)


def test_budget_evicts_prefixes_first_then_idle_sessions_lru_never_active_ones(drafter: OnnxDrafter) -> None:
    clock = Clock()
    s = store(100, clock)
    a, b, c = (s.create(drafter, GREEDY) for _ in range(3))
    for i, sess in enumerate((a, b, c)):
        s.propose(sess.id, 0, prompt(20, i), 4)  # each holds 20 + 3 drafted = 23
        clock.t += 1
    assert s.usage().used_tokens == 69
    s.release(c.id)  # c's 23 tokens become a prefix entry
    assert len(s.prefixes) == 1 and s.usage().entry_tokens == 23
    clock.t += 20  # a and b are idle now
    s.get(b.id)  # b is used again: protected
    d = s.create(drafter, GREEDY)
    s.propose(d.id, 0, prompt(30, 9), 4)  # 33 more: 69 + 33 > 100 -> the entry goes first (46 + 33 = 79)
    assert len(s.prefixes) == 0 and s.evictions() == {"session": 0, "prefix": 1}
    e = s.create(drafter, GREEDY)
    s.propose(e.id, 0, prompt(30, 10), 4)  # 79 + 33 > 100 -> a (idle, least recently used) is evicted
    assert s.evictions()["session"] == 1
    with pytest.raises(NotFound):
        s.propose(a.id, 20, [1], 2)
    s.propose(b.id, 20, [1], 2)  # b lives
    f = s.create(drafter, GREEDY)
    with pytest.raises(ResourceExhausted, match=r"needs \d+ more draft KV tokens: \d+ of this draft replica's "
                                                r"budget of 100 tokens"):
        s.propose(f.id, 0, prompt(40, 11), 4)  # b, d, e were all used within 10 s
    assert s.get(f.id).committed == []  # a refused call changes nothing
    clock.t += 20
    s.propose(f.id, 0, prompt(40, 11), 4)  # now the idle ones give way
    assert s.usage().used <= 100 and s.used_units == s.usage().used  # the running count is the recount


def test_model_free_drafters_hold_no_kv() -> None:
    s = store(1, Clock())
    pl = PromptLookupDrafter("pl", 34)
    for _ in range(3):
        sess = s.create(pl, GREEDY)
        s.propose(sess.id, 0, prompt(50, 1), 4)
    assert s.usage().used_tokens == 0


def test_a_prefix_hit_skips_its_prefill_and_drafts_what_a_cold_session_drafts(drafter: OnnxDrafter) -> None:
    clock = Clock()
    warm, cold = store(10_000, clock), store(10_000, clock, prefixes=False)
    system = prompt(40, 3)
    first = warm.create(drafter, GREEDY)
    warm.propose(first.id, 0, system + prompt(8, 4), 4)
    warm.release(first.id)  # release stores its KV
    (entry,) = warm.prefixes.entries()
    assert entry.tokens[:48] == system + prompt(8, 4) and entry.cache.length == len(entry.tokens)
    with pytest.raises(NotFound):  # a released session cannot be reached
        warm.get(first.id)
    ctx = system + prompt(12, 5)  # shares exactly the 40-token system prompt
    assert ctx[40] != entry.tokens[40]
    hit = warm.propose(warm.create(drafter, GREEDY).id, 0, ctx, 6).proposal
    miss = cold.propose(cold.create(drafter, GREEDY).id, 0, ctx, 6).proposal
    assert hit.cached_tokens == 40 and miss.cached_tokens == 0
    assert hit.fed_tokens == miss.fed_tokens - 40
    assert hit.token_ids == miss.token_ids
    for (hi, hp), (mi, mp) in zip(hit.q, miss.q):
        assert hi.tolist() == mi.tolist() and hp.tolist() == mp.tolist()
    assert warm.prefixes.queries_tokens["tiny"] == 48 + 52 and warm.prefixes.hits_tokens["tiny"] == 40
    assert warm.used_units == warm.usage().used == 51 + 57
    # the hit's own later rounds go on as usual (the copy is the session's own)
    sid = warm.create(drafter, GREEDY).id
    again = warm.propose(sid, 0, ctx, 6).proposal
    assert again.token_ids == miss.token_ids and again.cached_tokens == 40
    nxt = warm.propose(sid, len(ctx), again.token_ids[:2], 3).proposal
    ref = cold.propose(cold.create(drafter, GREEDY).id, 0, ctx + again.token_ids[:2], 3).proposal
    assert nxt.token_ids == ref.token_ids and nxt.cached_tokens == 0


def test_sampled_drafts_are_the_same_with_a_hit(drafter: OnnxDrafter) -> None:
    clock = Clock()
    warm, cold = store(10_000, clock), store(10_000, clock, prefixes=False)
    cfg = SamplingConfig(temperature=1.0, seed=7)
    base = prompt(30, 6)
    first = warm.create(drafter, cfg)
    warm.propose(first.id, 0, base, 2)
    warm.release(first.id)
    ctx = base + prompt(5, 8)
    hit = warm.propose(warm.create(drafter, cfg).id, 0, ctx, 5).proposal
    miss = cold.propose(cold.create(drafter, cfg).id, 0, ctx, 5).proposal
    assert hit.cached_tokens >= 30 and hit.token_ids == miss.token_ids
    for (_, hp), (_, mp) in zip(hit.q, miss.q):
        np.testing.assert_allclose(hp, mp, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ server
def _buffers(sess: Any) -> list[Any]:
    return [arr for _, arr in sess.state.cache.shared.values()] + list(sess.state.cache.arrays.values())


def test_a_fresh_session_holds_no_kv_memory_and_a_released_one_frees_what_it_does_not_store(
        drafter: OnnxDrafter) -> None:
    """A CPU session allocates its KV at its first forward, so a session that
    never drafts (AUTO at gamma 0 opens one per request) costs nothing. A
    released session whose KV does not become a prefix entry drops its
    buffers at once, whatever still refers to the session object (a
    cancelled stream's frames keep it until the garbage collector runs: the
    draft's RSS grew ~50 MiB a minute in the 16-chat soak before this). A
    stored one keeps them: the entry is that KV."""
    import gc
    import weakref

    s = store(10_000, Clock())
    idle = s.create(drafter, GREEDY)
    assert idle.state.cache.capacity == 0 and _buffers(idle) == []
    short, kept = s.create(drafter, GREEDY), s.create(drafter, GREEDY)
    s.propose(short.id, 0, [3, 4], 1)  # 2 + 1 tokens: too short for an entry
    s.propose(kept.id, 0, prompt(20, 3), 4)
    refs = {name: [weakref.ref(b) for b in _buffers(x)] for name, x in (("short", short), ("kept", kept))}
    assert all(refs.values())
    gc.disable()  # only reference counting: nothing waits for a collection
    try:
        for x in (idle, short, kept):
            s.release(x.id)
        # the test still holds the session objects, as a cycle would
        assert all(r() is None for r in refs["short"]) and _buffers(short) == []
        assert all(r() is not None for r in refs["kept"]) and len(s.prefixes) == 1
        (entry,) = s.prefixes.entries()
        assert entry.tokens[:20] == prompt(20, 3)
    finally:
        gc.enable()


def _config(tiny_models: TinyModels, tiny_onnx: TinyOnnx, **overrides: Any) -> DraftServiceConfig:
    cfg = DraftServiceConfig(
        drafters=[DrafterSpec(name="tiny", model=str(tiny_models.draft), precision="fp32")],
        host="127.0.0.1", port=0, intra_op_threads=1, cache_dir=tiny_onnx.cache_dir, max_sessions=8,
        warmup=False,
    )
    return dataclasses.replace(cfg, **overrides)


@contextlib.asynccontextmanager
async def serve(config: DraftServiceConfig) -> AsyncIterator[tuple[DraftServer, draft_pb2_grpc.DraftStub]]:
    server = await start(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, draft_pb2_grpc.DraftStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def _propose(sid: str, new: list[int], n: int, base: int = 0) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(session_id=sid, base_len=base, new_token_ids=new, num_tokens=n)


def test_server_budget_is_resource_exhausted_with_numbers_and_prefix_hits_are_reported(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx
) -> None:
    async def main() -> None:
        async with serve(_config(tiny_models, tiny_onnx, kv_budget_tokens=64)) as (server, stub):
            system = prompt(40, 12)
            a = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            r = await stub.Propose(_propose(a, system, 4))
            assert r.cached_prompt_tokens == 0 and len(r.token_ids) == 4
            b = (await stub.CreateSession(draft_pb2.CreateDraftSessionRequest())).session_id
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Propose(_propose(b, prompt(40, 13), 4))  # a (43 tokens) is active: never evicted
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 43 more draft KV tokens: 43 of this draft replica's budget of 64 tokens" in e.value.details()
            await stub.Release(common_pb2.ReleaseRequest(session_id=a))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Propose(_propose(a, [1], 2, base=40))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # released: unreachable
            assert len(server.sessions.prefixes) == 1
            r = await stub.Propose(_propose(b, system + prompt(6, 14), 4))  # same system prompt: a hit
            assert r.cached_prompt_tokens == 40
            text = generate_latest(server.servicer.metrics.registry).decode()
            assert 'specdec_draft_prefix_cache_hits_tokens_total{drafter="tiny"} 40.0' in text
            assert 'specdec_draft_prefix_cache_queries_tokens_total{drafter="tiny"} 126.0' in text
            assert "specdec_draft_kv_budget_tokens 64.0" in text
            assert 'specdec_draft_kv_evictions_total{kind="prefix"} 1.0' in text  # the entry gave way to b
            assert 'specdec_draft_kv_used_tokens{holder="sessions"} 49.0' in text

    asyncio.run(main())


def test_a_stream_that_ends_leaves_its_prefix_and_no_prefix_cache_leaves_none(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx
) -> None:
    async def run(prefix_cache: bool) -> int:
        async with serve(_config(tiny_models, tiny_onnx, prefix_cache=prefix_cache)) as (server, stub):
            tokens = prompt(20, 15)
            call = stub.Session()
            await call.write(draft_pb2.DraftSessionRequest(open=draft_pb2.DraftOpen(token_ids=tokens,
                                                                                    draft_until=24)))
            assert (await call.read()).HasField("opened")
            for _ in range(4):
                assert (await call.read()).HasField("token")
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            for _ in range(100):
                if len(server.sessions) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(server.sessions) == 0
            if not prefix_cache:
                assert server.sessions.prefixes is None
                return 0
            (entry,) = server.sessions.prefixes.entries()
            assert entry.tokens[:20] == tokens
            return len(server.sessions.prefixes)

    assert asyncio.run(run(True)) == 1
    assert asyncio.run(run(False)) == 0


def test_flags_reach_the_config_through_specdec_up() -> None:
    from draft_service.cli import config_from_args
    from specdec_app.cli import build_parser
    from specdec_app.up import child_commands

    a = build_parser().parse_args(["up", "--draft-kv-budget-tokens", "1000", "--draft-kv-protect-active", "0",
                                   "--no-draft-prefix-cache", "--draft-max-cache-tokens", "512"])
    cmds, _ = child_commands(a, "/tmp/cache")
    draft = cmds["draft"]
    assert draft[draft.index("--kv-budget-tokens") + 1] == "1000" and "--no-prefix-cache" in draft
    served = build_parser().parse_args(draft[draft.index("serve"):])
    cfg = config_from_args(served, 1)
    assert (cfg.kv_budget_tokens, cfg.kv_budget_bytes, cfg.kv_protect_active_s, cfg.prefix_cache,
            cfg.max_cache_tokens) == (1000, 0, 0.0, False, 512)
    on = config_from_args(build_parser().parse_args(["serve", "draft"]), 1)
    assert (on.kv_budget_tokens, on.kv_protect_active_s, on.prefix_cache) == (65_536, 10.0, True)


@pytest.mark.parametrize("draft_mode", ["unary", "stream"])
def test_a_full_draft_budget_runs_rounds_target_only_without_backing_the_replica_off(
    tiny_models: TinyModels, onnx_cache_dir: Any, draft_mode: str
) -> None:
    """Another session holds most of the draft's budget and stays active:
    the request's draft calls get RESOURCE_EXHAUSTED, its rounds fall back to
    target-only (same greedy tokens), and the draft replica is not backed off."""
    from tests.stack import start_stack

    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                     draft_overrides={"kv_budget_tokens": 64, "kv_protect_active_s": 1e6})
    try:
        off = st.generate(prompt="hello world", mode="off", max_new_tokens=40)
        hog = st.draft_stub().CreateSession(draft_pb2.CreateDraftSessionRequest()).session_id
        st.draft_stub().Propose(_propose(hog, prompt(40, 16), 4))  # 43 of the 64 tokens, never idle
        spec = st.generate(prompt="hello world", mode="fixed", gamma=4, max_new_tokens=40, draft_mode=draft_mode)
        assert spec["token_ids"] == off["token_ids"]
        assert spec["stats"].draft_failures > 0 and spec["stats"].draft_tokens > 0  # drafted until the budget ran out
        (replica,) = st.orchestrator.servicer.draft.pool.replicas.values()
        assert replica.failures == 0 and replica.available(st.orchestrator.servicer.draft.pool.clock())
        st.draft_stub().Release(common_pb2.ReleaseRequest(session_id=hog))
    finally:
        st.close()


def test_a_different_tokenizer_drafter_reuses_its_draft_ids_prefix(multi_stack: Stack, tli_models: TliModels) -> None:
    """tli keys its entries by the draft model's ids (the re-tokenized text): a
    second session on the same text takes them and drafts the same tokens."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tli_models.target)).encode("the thin winter, the other tower, the end")
    stub = multi_stack.draft_stub()
    replies = []
    for _ in range(2):
        sid = stub.CreateSession(draft_pb2.CreateDraftSessionRequest(drafter="tli")).session_id
        replies.append(stub.Propose(_propose(sid, ids, 4)))
        stub.Release(common_pb2.ReleaseRequest(session_id=sid))
    assert replies[0].cached_prompt_tokens == 0 and replies[1].cached_prompt_tokens > 0
    assert list(replies[1].token_ids) == list(replies[0].token_ids) and len(replies[0].token_ids) > 0
