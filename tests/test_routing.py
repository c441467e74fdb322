"""Routing over target and draft replicas (orchestrator/routing.py), without
gRPC: endpoints are in-memory fakes with the client surface the routers call.
The multi-process behaviour is in tests/test_multi_replica.py."""

from __future__ import annotations

import asyncio
import collections
import math
import random
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import RoutingConfig
from orchestrator.protocols import PrefillReply, ProposeReply, VerifyReply
from orchestrator.routing import (
    ReplicaPool,
    RoutedDraft,
    RoutedTarget,
    bounded_load_order,
    parse_addresses,
    rendezvous_order,
    two_choices_order,
)
from specdec.errors import AlreadyExists, Internal, NotFound, Unavailable
from specdec.sampling import SamplingConfig

CFG = SamplingConfig()


class FakeService:
    """Target and draft calls of one replica; ``down`` makes every call UNAVAILABLE."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.down = False
        self.sessions: set[str] = set()
        self.created = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def _call(self, method: str) -> None:
        self.calls[method] += 1
        if self.down:
            raise Unavailable(f"{self.address} is down")

    def _new(self) -> str:
        self.created += 1
        sid = f"{self.address}/{self.created}"
        self.sessions.add(sid)
        return sid

    def _known(self, sid: str) -> None:
        if sid not in self.sessions:
            raise NotFound(f"session {sid}")

    async def info(self, timeout: float | None = None, drafter: str = "") -> str:
        self._call("info")
        return self.address

    async def prefill(self, token_ids: Any, cfg: Any, sample_next: bool, rng_offset: int, timeout: Any,
                      options: Any = None, session_id: str = "") -> PrefillReply:  # ignores the id, as an older target
        self._call("prefill")
        return PrefillReply(self._new(), 1, 0.0, len(token_ids), 0.0)

    async def verify(self, sid: str, cache_len: int, new_ids: Any, draft_ids: Any, q: Any, timeout: Any,
                     post: Any = None, ahead: int = 0, stop_ids: Any = (),
                     ahead_lookup: int = 0) -> VerifyReply:
        self._call("verify")
        self._known(sid)
        return VerifyReply(0, 1, cache_len + len(new_ids), [0.0], 0.0, 0.0)

    async def create(self, cfg: Any, drafter: str, timeout: Any, rng_offset: int = 0, options: Any = None,
                     session_id: str = "") -> str:  # ignores the id, as an older draft
        self._call("create")
        return self._new()

    async def propose(self, sid: str, base_len: int, new_ids: Any, n: int, conf: float, timeout: Any) -> ProposeReply:
        self._call("propose")
        self._known(sid)
        return ProposeReply([1] * n, [], base_len + len(new_ids), 0.0)

    async def release(self, sid: str, timeout: Any) -> None:
        self._call("release")
        self.sessions.discard(sid)


class FakeEndpoint:
    def __init__(self, service: FakeService) -> None:
        self.client = service
        self.closed = False

    async def check(self, timeout: float) -> bool:
        return not self.client.down and not self.closed

    async def close(self) -> None:
        self.closed = True


class Cluster:
    """Fake replicas by address, a fake clock, and a pool over them."""

    def __init__(self, entries: list[str], **cfg: Any) -> None:
        self.services: dict[str, FakeService] = {}
        self.endpoints: dict[str, FakeEndpoint] = {}
        self.now = 0.0
        self.dns: dict[str, list[str]] = {}
        self.pool: ReplicaPool[Any] = ReplicaPool(
            "target", entries, self.connect, RoutingConfig(**cfg), resolver=self.resolve,
            clock=lambda: self.now, rng=random.Random(0),
        )

    def connect(self, address: str) -> FakeEndpoint:
        svc = self.services.setdefault(address, FakeService(address))
        self.endpoints[address] = FakeEndpoint(svc)
        return self.endpoints[address]

    def resolve(self, host: str, port: int) -> list[str]:
        if host not in self.dns:
            raise OSError(f"lookup {host} failed")
        return [f"{ip}:{port}" for ip in self.dns[host]]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---------------------------------------------------------------- addresses
def test_parse_addresses_accepts_lists_dns_and_files() -> None:
    assert parse_addresses("a:1, dns:///svc.ns:50053,,file:///tmp/eps, [::1]:9") == [
        "a:1", "dns:///svc.ns:50053", "file:///tmp/eps", "[::1]:9"]
    assert parse_addresses("") == []
    for bad in ("nohost", "a:", "a:99999", "dns:///noport", "http://a:1", "file://"):
        with pytest.raises(ValueError):
            parse_addresses(bad)


# ------------------------------------------------------------------ hashing
def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    addrs = [f"10.0.0.{i}:50053" for i in range(5)]
    keys = [f"req-{i}" for i in range(2000)]
    before = {k: rendezvous_order(k, addrs)[0] for k in keys}
    assert before == {k: rendezvous_order(k, list(reversed(addrs)))[0] for k in keys}  # order-independent
    counts = collections.Counter(before.values())
    assert min(counts.values()) > 2000 / 5 * 0.8  # spread
    after = {k: rendezvous_order(k, addrs[1:])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == addrs[0] for k in moved)
    # the moved keys land on their second choice: the failover order
    assert all(after[k] == rendezvous_order(k, addrs)[1] for k in moved)


def test_bounded_load_caps_every_replica() -> None:
    """Keys that all hash to one replica still spread: no replica takes more
    than ceil(c × (sessions + 1) / n)."""
    loads = {f"r{i}": 0 for i in range(4)}
    c = 1.25
    for i in range(400):
        total = sum(loads.values())
        first = bounded_load_order(f"k{i}", loads, c)[0]
        assert loads[first] + 1 <= math.ceil(c * (total + 1) / len(loads))
        loads[first] += 1
    assert max(loads.values()) <= math.ceil(c * 400 / 4)
    # with room everywhere the key's own rendezvous choice wins (affinity)
    empty = {a: 0 for a in loads}
    assert bounded_load_order("x", empty, c)[0] == rendezvous_order("x", list(empty))[0]


def test_two_choices_prefers_the_less_loaded() -> None:
    rng = random.Random(1)
    assert {two_choices_order({"a": 5, "b": 0}, rng)[0] for _ in range(20)} == {"b"}
    firsts = collections.Counter(two_choices_order({"a": 0, "b": 0, "c": 9}, rng)[0] for _ in range(300))
    assert firsts["c"] == 0 and firsts["a"] > 50 and firsts["b"] > 50
    assert two_choices_order({"a": 3, "b": 1, "c": 2}, rng)[1:] in (["c", "a"], ["b", "a"])


# -------------------------------------------------------------------- pools
def test_session_affinity_and_failover_order() -> None:
    async def go() -> None:
        cl = Cluster(["t0:1", "t1:1", "t2:1"], backoff_s=5.0)
        await cl.pool.start()
        order = [r.address for r in cl.pool.target_order("req")]
        bound = RoutedTarget(cl.pool, "req")
        p = await bound.prefill([1, 2, 3], CFG, True, 0, None)
        home = cl.services[order[0]]
        assert p.session_id in home.sessions
        for _ in range(5):  # every verify goes to the replica holding the cache
            await bound.verify(p.session_id, 3, [1], [], [], None)
        assert home.calls["verify"] == 5
        assert sum(s.calls["verify"] for s in cl.services.values()) == 5
        assert cl.pool.replicas[home.address].sessions == 1
        # the home replica dies: the verify fails, the rebuild goes to the next in order
        home.down = True
        with pytest.raises(Unavailable):
            await bound.verify(p.session_id, 3, [1], [], [], None)
        assert cl.pool.replicas[home.address].sessions == 0
        assert not cl.pool.replicas[home.address].available(cl.now)  # backed off
        p2 = await bound.prefill([1, 2, 3, 1], CFG, False, 4, None)
        assert p2.session_id in cl.services[order[1]].sessions
        # the next one dies too: its prefill moves on to the third
        cl.services[order[1]].down = True
        p3 = await RoutedTarget(cl.pool, "req").prefill([1], CFG, True, 0, None)
        assert p3.session_id in cl.services[order[2]].sessions
        # all down: UNAVAILABLE that names the service
        cl.services[order[2]].down = True
        with pytest.raises(Unavailable, match="no target replica"):
            await RoutedTarget(cl.pool, "other").prefill([1], CFG, True, 0, None)
        # back up after the backoff and a health check: the key's own replica again
        for s in cl.services.values():
            s.down = False
        cl.now += 31.0
        await cl.pool.check_health()
        p4 = await RoutedTarget(cl.pool, "req").prefill([1], CFG, True, 0, None)
        assert p4.session_id in home.sessions
        await bound.release(p2.session_id, None)
        assert p2.session_id not in cl.services[order[1]].sessions
        await cl.pool.close()

    run(go())


def test_one_outage_seen_by_many_calls_backs_off_once() -> None:
    """2000 calls failing inside one backoff window (streams meeting the same
    outage, as in the chaos soak's draft kill) back the replica off once: not
    doubled per call, which reached the 30 s cap at the fifth call and past
    the 1025th raised OverflowError out of every request that touched the
    replica (UNKNOWN to healthy clients). A failure after the window ends
    doubles it, up to the cap."""
    async def go() -> None:
        cl = Cluster(["t0:1"], backoff_s=2.0, max_backoff_s=30.0)
        await cl.pool.start()
        r = cl.pool.replicas["t0:1"]

        async def down(_client: Any) -> Any:
            raise Unavailable("target: connection refused")

        for _ in range(2000):
            with pytest.raises(Unavailable):
                await cl.pool.call(r, down)
        assert r.down_until == cl.now + 2.0
        for want in (4.0, 8.0, 16.0, 30.0, 30.0):
            cl.now = r.down_until + 0.1
            with pytest.raises(Unavailable):
                await cl.pool.call(r, down)
            assert r.down_until == cl.now + want
        await cl.pool.close()

    run(go())


def test_a_replica_not_serving_gets_new_sessions_only_as_a_last_resort() -> None:
    async def go() -> None:
        cl = Cluster(["a:1", "b:1"])
        await cl.pool.start()
        cl.endpoints["a:1"].closed = True  # health check fails (draining / loading)
        await cl.pool.check_health()
        for i in range(10):
            p = await RoutedTarget(cl.pool, f"k{i}").prefill([1], CFG, True, 0, None)
            assert p.session_id.startswith("b:1/")
        cl.services["b:1"].down = True
        p = await RoutedTarget(cl.pool, "k").prefill([1], CFG, True, 0, None)
        assert p.session_id.startswith("a:1/")  # tried last, and it answered

    run(go())


def test_readiness_polls_do_not_back_a_loading_replica_off() -> None:
    """GetModelInfo while a replica loads its model answers UNAVAILABLE; that
    is not a failure, so the replica takes sessions as soon as it is ready
    (a session call that fails does back it off)."""

    async def go() -> None:
        cl = Cluster(["a:1"])
        await cl.pool.start()
        cl.services["a:1"].down = True  # still loading
        for _ in range(5):
            with pytest.raises(Unavailable):
                await cl.pool.info(1.0)
        replica = cl.pool.replicas["a:1"]
        assert replica.failures == 0 and replica.available(cl.now)
        cl.services["a:1"].down = False  # loaded
        assert await cl.pool.info(1.0) == "a:1"
        cl.services["a:1"].down = True
        with pytest.raises(Unavailable):
            await RoutedTarget(cl.pool, "k").prefill([1], CFG, True, 0, None)
        assert replica.failures == 1 and not replica.available(cl.now)

    run(go())


def test_draft_replica_failure_reports_the_session_lost() -> None:
    """A failed draft replica surfaces as NOT_FOUND, so the decode loop
    recreates the session, which lands on another replica."""

    async def go() -> None:
        cl = Cluster(["d0:1", "d1:1"])
        await cl.pool.start()
        bound = RoutedDraft(cl.pool, "req")
        sid = await bound.create(CFG, "", None)
        home = sid.split("/")[0]
        other = "d1:1" if home == "d0:1" else "d0:1"
        await bound.propose(sid, 0, [1, 2], 3, 0.0, None)
        cl.services[home].down = True
        with pytest.raises(NotFound):
            await bound.propose(sid, 2, [], 3, 0.0, None)
        sid2 = await bound.create(CFG, "", None)
        assert sid2.startswith(other + "/")
        assert (await bound.propose(sid2, 0, [1, 2], 2, 0.0, None)).token_ids == [1, 1]
        with pytest.raises(NotFound):  # the lost session is not routed anywhere
            await bound.propose(sid, 2, [], 3, 0.0, None)

    run(go())


class NamingService(FakeService):
    """A replica that uses the id its caller names and then, per ``after``,
    answers, loses the reply (``"lost"``: the session exists, the caller
    sees UNAVAILABLE), fails with another status, or hangs until cancelled."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.after = "ok"
        self.named: list[str] = []

    async def _create(self, session_id: str) -> str:
        self._call("create")
        self.named.append(session_id)
        if session_id in self.sessions:
            raise AlreadyExists(session_id)
        self.sessions.add(session_id)
        if self.after == "lost":
            raise Unavailable("connection reset before the reply (test)")
        if self.after == "internal":
            raise Internal("a fault after the session was made (test)")
        if self.after == "hang":
            await asyncio.sleep(3600)
        return session_id

    async def prefill(self, token_ids: Any, cfg: Any, sample_next: bool, rng_offset: int, timeout: Any,
                      options: Any = None, session_id: str = "") -> PrefillReply:
        return PrefillReply(await self._create(session_id), 1, 0.0, len(token_ids), 0.0)

    async def create(self, cfg: Any, drafter: str, timeout: Any, rng_offset: int = 0, options: Any = None,
                     session_id: str = "") -> str:
        return await self._create(session_id)


def test_a_failed_or_cancelled_create_releases_the_id_it_named() -> None:
    """Each create names a fresh id; whatever way it fails (the reply lost,
    an INTERNAL fault, the request cancelled mid-call), the replica it was
    sent to releases that id in the background: nothing is left for the
    TTL. ALREADY_EXISTS (the id is another session's) releases nothing."""

    async def settle(pool: ReplicaPool[Any]) -> None:
        await asyncio.wait_for(asyncio.gather(*pool._releases), 5)

    async def go() -> None:
        cl = Cluster(["t0:1", "t1:1"])
        for a in ("t0:1", "t1:1"):
            cl.services[a] = NamingService(a)
        await cl.pool.start()
        order = [r.address for r in cl.pool.target_order("req")]
        first, second = (cl.services[a] for a in order)
        assert isinstance(first, NamingService) and isinstance(second, NamingService)
        # the reply is lost on the first replica: the session there is released, the second serves
        first.after = "lost"
        p = await RoutedTarget(cl.pool, "req").prefill([1, 2], CFG, True, 0, None)
        await settle(cl.pool)
        assert first.sessions == set() and first.calls["release"] == 1
        assert second.sessions == {p.session_id} and len(p.session_id) == 32 and p.session_id != first.named[0]
        # an INTERNAL fault after creating: not retried elsewhere, released
        cl.now += 1000.0  # past the first replica's backoff: it is first again
        first.after = "internal"
        with pytest.raises(Internal):
            await RoutedTarget(cl.pool, "req").prefill([1, 2], CFG, True, 0, None)
        await settle(cl.pool)
        assert first.sessions == set()
        # the request is cancelled while its create runs
        first.after = "hang"
        task = asyncio.ensure_future(RoutedTarget(cl.pool, "req").prefill([1, 2], CFG, True, 0, None))
        while len(first.named) < 3:
            await asyncio.sleep(0.01)
        assert first.sessions == {first.named[2]}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(cl.pool)
        assert first.sessions == set()
        # the same for a draft session, on whichever replica it goes to
        second.sessions.clear()
        first.after = second.after = "internal"
        with pytest.raises(Internal):
            await RoutedDraft(cl.pool, "req").create(CFG, "", None)
        await settle(cl.pool)
        assert first.sessions == second.sessions == set() and len(first.named + second.named) == 5
        # an id another session holds: that session is kept
        first.after = "ok"
        first.sessions.add("taken")
        with pytest.raises(AlreadyExists):
            await cl.pool.first_create([cl.pool.replicas[first.address]],
                                       lambda c, _sid: c.create(CFG, "", None, session_id="taken"), 2.0)
        await settle(cl.pool)
        assert first.sessions == {"taken"}

    run(go())


def test_draft_sessions_spread_by_load() -> None:
    async def go() -> None:
        cl = Cluster(["d0:1", "d1:1", "d2:1"])
        await cl.pool.start()
        for i in range(30):
            await RoutedDraft(cl.pool, f"r{i}").create(CFG, "", None)
        loads = sorted(r.sessions for r in cl.pool.replicas.values())
        assert loads[-1] - loads[0] <= 2

    run(go())


def test_discovery_refresh_from_a_file_and_dns(tmp_path: Path) -> None:
    async def go() -> None:
        eps = tmp_path / "endpoints"
        eps.write_text("# draft replicas\nf0:1\n")
        cl = Cluster([f"file://{eps}", "dns:///svc:50052", "static:9"], close_removed_after_s=30.0,
                     health_interval_s=0.02)
        cl.dns["svc"] = ["10.0.0.1", "10.0.0.2"]
        await cl.pool.start()
        assert set(cl.pool.replicas) == {"f0:1", "10.0.0.1:50052", "10.0.0.2:50052", "static:9"}
        # a session on a replica that will disappear
        bound = RoutedTarget(cl.pool, "k")
        loads = {a: 0 for a in cl.pool.replicas}
        for a in loads:
            if a != "10.0.0.2:50052":
                loads[a] = 99
                cl.pool.replicas[a].sessions = 99
        p = await bound.prefill([1], CFG, True, 0, None)
        assert p.session_id.startswith("10.0.0.2:50052/")
        for a, r in cl.pool.replicas.items():
            if a != "10.0.0.2:50052":
                r.sessions = 0
        # scale: a new file entry, one DNS record gone; a failed lookup keeps the rest
        eps.write_text("f0:1\nf1:1\n")
        cl.dns["svc"] = ["10.0.0.1"]
        await cl.pool.refresh()
        assert set(cl.pool.replicas) == {"f0:1", "f1:1", "10.0.0.1:50052", "static:9"}
        assert cl.pool.replicas["f1:1"].serving
        gone = cl.endpoints["10.0.0.2:50052"]
        await asyncio.sleep(0.05)
        assert not gone.closed  # its session is still running: drained, not cut
        await bound.verify(p.session_id, 1, [1], [], [], None)  # still routed to it
        await bound.release(p.session_id, None)
        for _ in range(50):
            if gone.closed:
                break
            await asyncio.sleep(0.02)
        assert gone.closed  # closed once idle
        del cl.dns["svc"]
        eps.unlink()
        await cl.pool.refresh()
        assert set(cl.pool.replicas) == {"f0:1", "f1:1", "10.0.0.1:50052", "static:9"}
        await cl.pool.close()
        assert all(e.closed for e in cl.endpoints.values())

    run(go())


def test_cli_builds_the_routing_config() -> None:
    from orchestrator.cli import config_from_args as orchestrator_config
    from specdec_app.cli import build_parser

    def config(*flags: str) -> Any:
        a = build_parser().parse_args(["serve", "orchestrator", *flags])
        return orchestrator_config(a, 50051)

    cfg = config("--target-address", "t1:50053, dns:///specdec-target-headless:50053", "--draft-address", "",
                 "--discovery-interval", "1.5", "--target-load-factor", "2")
    assert cfg.target_addresses == ["t1:50053", "dns:///specdec-target-headless:50053"]
    assert cfg.draft_addresses == []  # target-only
    assert (cfg.routing.discovery_interval_s, cfg.routing.target_load_factor) == (1.5, 2.0)
    assert config().target_addresses == ["127.0.0.1:50053"]  # `specdec up` and the defaults: one each
    for bad in (["--target-address", "no-port"], ["--target-address", ""], ["--draft-address", "grpc://d:1"],
                ["--target-load-factor", "0.5"]):
        with pytest.raises(SystemExit, match="specdec:"):
            config(*bad)


def test_dns_entries_resolve_through_getaddrinfo() -> None:
    """The real resolver (a headless Service name resolves the same way, one record per pod)."""
    from orchestrator.routing import resolve_dns

    addrs = resolve_dns("localhost", 50053)
    assert addrs and set(addrs) <= {"127.0.0.1:50053", "[::1]:50053"}
    with pytest.raises(OSError):
        resolve_dns("no-such-host.invalid", 1)
