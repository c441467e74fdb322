"""Routing over N target and M draft replicas.

Plain typed Python: the gRPC specifics (channels, stubs, health checks) sit
behind the small ``Endpoint`` protocol, so pools and routers are unit-tested
with fakes.

- **Discovery.** Each service is given entries: ``host:port`` (static),
  ``dns:///name:port`` (A/AAAA records via ``socket.getaddrinfo`` in a thread,
  re-resolved every ``discovery_interval_s``: a Kubernetes headless Service)
  or ``file:///path`` (one ``host:port`` per line, ``#`` comments, re-read
  every ``discovery_interval_s``: for tests and for a sidecar that writes
  endpoints). Addresses that appear get a channel; addresses that disappear
  stop getting new sessions, and their channel is closed once the sessions
  on it ended (they fail over if the replica dies; ``close_removed_after_s``
  is a safety net). A failed lookup keeps the previous addresses of that
  entry.
- **Health.** Every ``health_interval_s`` each replica gets a
  ``grpc.health.v1`` Check: new sessions go to SERVING replicas first (so a
  pod still loading its model, or draining, gets none). A call that fails
  with UNAVAILABLE (or a dead connection) puts the replica in backoff
  (``backoff_s``, doubling to ``max_backoff_s`` per failure after the
  previous backoff ended: concurrent failures of one outage count once); a
  call that succeeds ends it. Replicas not available are still tried last, so one lagging health
  check never fails a request.
- **Targets** (KV cache per session) are chosen per request key by
  rendezvous hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
  2018): the first replica in the key's rendezvous order that holds fewer
  than ``ceil(c × (sessions + 1) / replicas)`` of this orchestrator's
  sessions, c = ``target_load_factor``. A session's Verify calls always go to
  the replica that holds its cache; when that replica fails, the request's
  next Prefill (the rebuild) walks the same order and lands on the next one
  that runs the same numerics (dtype/backend, from each replica's ModelInfo)
  as the request's first session; none left is UNAVAILABLE.
- **Errors.** Only UNAVAILABLE backs a replica off. A session left behind
  after one (the call may be all that was lost) is released in the
  background, best effort (docs/reliability.md).
- **Drafts** are chosen at session creation by the power of two choices on
  load (sessions + in-flight calls); a session then stays on its replica.
  When its replica fails the session is reported lost (NOT_FOUND), so the
  decode loop recreates it on another replica from the committed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Generic, Protocol, Sequence, TypeVar

from orchestrator.config import RoutingConfig
from orchestrator.placement import (  # noqa: F401  (re-exported: the routing API)
    DNS_PREFIX,
    FILE_PREFIX,
    split_host_port,
    join_host_port,
    parse_addresses,
    resolve_dns,
    read_endpoints_file,
    rendezvous_order,
    bounded_load_order,
    two_choices_order,
)
from orchestrator.protocols import (  # noqa: F401  (Endpoint, RoutingEvents, NoEvents: re-exported)
    Endpoint,
    NoEvents,
    PostToken,
    PrefillReply,
    ProposeReply,
    RoutingEvents,
    SessionOptions,
    VerifyReply,
)
from specdec.errors import AlreadyExists, NotFound, ResourceExhausted, SpecdecError, Unavailable
from specdec.logging_util import log
from specdec.sampling import SamplingConfig, SparseQ
from specdec.session_ids import new_session_id

logger = logging.getLogger("specdec.orchestrator.routing")

C = TypeVar("C")
T = TypeVar("T")

# ------------------------------------------------------------------- replicas
@dataclass(eq=False)
class Replica(Generic[C]):
    address: str
    endpoint: Endpoint
    sessions: int = 0  # sessions this orchestrator holds on it
    in_flight: int = 0  # calls in progress
    serving: bool = False  # last health check said SERVING
    down_until: float = 0.0  # no new sessions before this (backoff after a failed call)
    failures: int = 0  # consecutive failed calls
    removed: bool = False  # gone from discovery
    sessions_created: int = 0
    # what the replica computes with (targets: "dtype/backend" from its
    # ModelInfo; "" = not known yet), read when it turns SERVING or after it failed
    numerics: str = ""

    @property
    def client(self) -> C:
        return self.endpoint.client  # type: ignore[no-any-return]

    def available(self, now: float) -> bool:
        return self.serving and not self.removed and now >= self.down_until


@dataclass
class ReplicaPool(Generic[C]):
    """The replicas of one service, kept current by discovery and health checks."""

    service: str
    entries: list[str]
    connect: Callable[[str], Endpoint]
    cfg: RoutingConfig = field(default_factory=RoutingConfig)
    events: RoutingEvents = field(default_factory=NoEvents)
    resolver: Callable[[str, int], list[str]] = resolve_dns
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    # reads a replica's numerics from its client (targets: ModelInfo's dtype
    # and backend); None = the service's replicas all count as alike
    numerics_of: Callable[[C], Awaitable[str]] | None = None
    replicas: dict[str, Replica[C]] = field(default_factory=dict)
    _last: dict[str, list[str]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _retiring: set[asyncio.Task[None]] = field(default_factory=set)
    _releases: set[asyncio.Future[Any]] = field(default_factory=set)  # best-effort releases in flight

    @property
    def dynamic(self) -> bool:
        return any(e.startswith((DNS_PREFIX, FILE_PREFIX)) for e in self.entries)

    # ------------------------------------------------------------ discovery
    async def resolve(self) -> list[str]:
        out: list[str] = []
        for e in self.entries:
            try:
                if e.startswith(DNS_PREFIX):
                    host, port = split_host_port(e[len(DNS_PREFIX):])
                    addrs = await asyncio.to_thread(self.resolver, host, port)
                elif e.startswith(FILE_PREFIX):
                    addrs = await asyncio.to_thread(read_endpoints_file, e[len(FILE_PREFIX):])
                else:
                    addrs = [e]
            except (OSError, ValueError) as err:
                addrs = self._last.get(e, [])
                log(logger, logging.WARNING, "endpoint discovery failed; keeping the previous addresses",
                    service=self.service, entry=e, error=str(err), kept=len(addrs))
            self._last[e] = addrs
            out.extend(a for a in addrs if a not in out)
        return out

    async def refresh(self) -> None:
        """Re-resolves the entries, adds and retires replicas, then health-checks all."""
        addrs = await self.resolve()
        for a in addrs:
            if a not in self.replicas:
                r: Replica[C] = Replica(a, self.connect(a))
                self.replicas[a] = r
                self.events.replica_added(self.service, r)
                log(logger, logging.INFO, "replica added", service=self.service, address=a)
        for a in [a for a in self.replicas if a not in addrs]:
            self._retire(self.replicas.pop(a))
        await self.check_health()

    def _retire(self, r: Replica[C]) -> None:
        r.removed = True
        self.events.replica_removed(self.service, r.address)
        log(logger, logging.INFO, "replica removed; closing once idle", service=self.service, address=r.address,
            sessions=r.sessions)

        async def close_when_idle() -> None:
            deadline = self.clock() + self.cfg.close_removed_after_s
            while (r.sessions or r.in_flight) and self.clock() < deadline:
                await asyncio.sleep(min(1.0, self.cfg.health_interval_s))
            await r.endpoint.close()

        task = asyncio.ensure_future(close_when_idle())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def check_health(self) -> None:
        replicas = list(self.replicas.values())

        async def one(r: Replica[C]) -> None:
            try:
                ok = await r.endpoint.check(self.cfg.health_timeout_s)
            except Exception:  # a health check never breaks routing
                ok = False
            if ok != r.serving:
                log(logger, logging.INFO, "replica health changed", service=self.service, address=r.address,
                    serving=ok)
            # a replica turning SERVING, or one that failed a call since (it may
            # have restarted), may have recalibrated: read its numerics again
            relearn = ok and (not r.serving or r.failures > 0 or not r.numerics)
            r.serving = ok
            if relearn and self.numerics_of is not None:
                await self._learn_numerics(r)

        await asyncio.gather(*(one(r) for r in replicas))
        kinds = {r.numerics for r in self.replicas.values() if r.numerics}
        if len(kinds) > 1:
            log(logger, logging.WARNING, "replicas run different numerics; a session is only rebuilt on a "
                "replica with its own", service=self.service,
                numerics={r.address: r.numerics for r in self.replicas.values()})
        now = self.clock()
        up = sum(1 for r in self.replicas.values() if r.available(now))
        self.events.replicas_changed(self.service, up, len(self.replicas) - up)

    async def _learn_numerics(self, r: Replica[C]) -> None:
        assert self.numerics_of is not None
        try:
            numerics = await asyncio.wait_for(self.numerics_of(r.client), self.cfg.health_timeout_s)
        except Exception as e:  # not known yet: the replica takes no rebuilds until it is
            log(logger, logging.WARNING, "replica numerics not read", service=self.service, address=r.address,
                error=repr(e))
            return
        if numerics != r.numerics:
            log(logger, logging.INFO, "replica numerics", service=self.service, address=r.address,
                numerics=numerics, before=r.numerics or None)
        r.numerics = numerics

    def release_later(self, r: Replica[C], session_id: str, timeout: float) -> None:
        """Releases ``session_id`` on ``r`` off the caller's path, best effort
        (bounded by ``timeout``; a failure is logged, never raised): for a
        session the caller stops using after an error that may have left it
        alive on the replica (docs/reliability.md, "Sessions left behind")."""

        async def release() -> None:
            try:
                await asyncio.wait_for(r.client.release(session_id, timeout), timeout)
            except NotFound:
                pass
            except Exception as e:
                log(logger, logging.INFO, "best-effort release failed (the replica's TTL reaps it)",
                    service=self.service, address=r.address, session_id=session_id, error=repr(e))

        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        last_resolve = self.clock()
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                if self.dynamic and self.clock() - last_resolve >= self.cfg.discovery_interval_s:
                    last_resolve = self.clock()
                    await self.refresh()
                else:
                    await self.check_health()
            except Exception as e:  # pragma: no cover - defensive: the loop must survive
                log(logger, logging.ERROR, "routing refresh failed", service=self.service, error=repr(e))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._retiring):
            t.cancel()
        if self._releases:  # give the best-effort releases their (bounded) chance
            await asyncio.wait(list(self._releases), timeout=self.cfg.health_timeout_s)
        for r in list(self.replicas.values()):
            await r.endpoint.close()
        self.replicas.clear()

    # ---------------------------------------------------------------- calls
    def mark_failed(self, r: Replica[C], error: str) -> None:
        """Backs ``r`` off for ``backoff_s``, doubled per failure up to
        ``max_backoff_s``. Calls that fail while it is already backed off
        (other streams meeting the same outage) count, and restart the
        window, but do not double it: one outage seen by 32 streams is one
        failure, not 2^32 (which also overflowed the float)."""
        now = self.clock()
        escalate = now >= r.down_until
        if escalate:
            r.failures += 1
        backoff = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2.0 ** min(max(r.failures - 1, 0), 30))
        r.down_until = now + backoff
        self.events.replica_failed(self.service, r.address, error)
        if escalate:  # once per window, not once per failed call
            log(logger, logging.WARNING, "replica failed; backing off", service=self.service, address=r.address,
                backoff_s=backoff, error=error)

    async def call(self, r: Replica[C], fn: Callable[[C], Awaitable[T]], back_off: bool = True) -> T:
        """Runs one call on ``r``; UNAVAILABLE (including a dead connection)
        backs the replica off unless ``back_off`` is False (readiness polls:
        a replica still loading its model has not failed). Nothing else
        does: INVALID_ARGUMENT is the request's fault and INTERNAL a server
        fault that says nothing about the replica's reachability
        (docs/reliability.md, "Error classification")."""
        r.in_flight += 1
        try:
            result = await fn(r.client)
        except Unavailable as e:
            if back_off:
                self.mark_failed(r, e.message)
            raise
        finally:
            r.in_flight -= 1
        r.failures, r.down_until = 0, 0.0  # it answered: no backoff (health checks still gate new sessions)
        return result

    def _split(self) -> tuple[list[Replica[C]], list[Replica[C]]]:
        now = self.clock()
        up = [r for r in self.replicas.values() if r.available(now)]
        down = [r for r in self.replicas.values() if not r.available(now)]
        return up, down

    def target_order(self, key: str) -> list[Replica[C]]:
        """Replicas to try for a new session of ``key``: available ones by
        bounded-load rendezvous hashing, then the others by rendezvous."""
        up, down = self._split()
        first = bounded_load_order(key, {r.address: r.sessions for r in up}, self.cfg.target_load_factor)
        last = rendezvous_order(key, [r.address for r in down])
        return [self.replicas[a] for a in first + last]

    def draft_order(self) -> list[Replica[C]]:
        """Replicas to try for a new draft session: two random choices on load, then the rest."""
        up, down = self._split()
        first = two_choices_order({r.address: r.sessions + r.in_flight for r in up}, self.rng)
        last = sorted(down, key=lambda r: (r.sessions + r.in_flight, r.address))
        return [self.replicas[a] for a in first] + last

    async def first_success(
        self, order: list[Replica[C]], fn: Callable[[C], Awaitable[T]], back_off: bool = True
    ) -> tuple[Replica[C], T]:
        """Tries ``fn`` on each replica in order; UNAVAILABLE and RESOURCE_EXHAUSTED move on."""
        return await self._first(order, lambda c, _sid: fn(c), back_off, None)

    async def first_create(
        self, order: list[Replica[C]], fn: Callable[[C, str], Awaitable[T]], release_timeout_s: float
    ) -> tuple[Replica[C], T]:
        """``first_success`` for a call that creates a session the caller
        names: each try passes ``fn`` a fresh id, and a try that fails in any
        way (cancelled, deadline, UNAVAILABLE, INTERNAL, ...) releases that
        id on its replica in the background, since the replica may have
        created the session all the same (the reply lost, or the caller's
        deadline beat it). ALREADY_EXISTS names another session: kept."""
        return await self._first(order, fn, True, release_timeout_s)

    async def _first(
        self, order: list[Replica[C]], fn: Callable[[C, str], Awaitable[T]], back_off: bool,
        release_timeout_s: float | None,
    ) -> tuple[Replica[C], T]:
        if not order:
            raise Unavailable(f"no {self.service} replicas discovered from {', '.join(self.entries) or '(none)'}")
        last: SpecdecError | None = None
        for r in order:
            sid = new_session_id() if release_timeout_s is not None else ""
            try:
                return r, await self.call(r, lambda c: fn(c, sid), back_off)
            except BaseException as e:  # CancelledError included: the request itself is gone
                if release_timeout_s is not None and not isinstance(e, AlreadyExists):
                    self.release_later(r, sid, release_timeout_s)
                if not isinstance(e, (Unavailable, ResourceExhausted)):
                    raise
                last = e
        assert last is not None
        raise type(last)(f"no {self.service} replica could serve the call ({len(order)} tried); last: {last.message}")

    async def info(self, timeout: float | None = None, drafter: str = "") -> Any:
        _, reply = await self.first_success(
            self.draft_order(), lambda c: c.info(timeout=timeout, drafter=drafter), back_off=False
        )
        return reply


# -------------------------------------------------------- per-request clients
class _Bound(Generic[C]):
    """One request's view of a pool: remembers which replica holds each of its sessions."""

    #: bound on a best-effort release of a session left behind after an error
    RELEASE_TIMEOUT_S = 2.0

    def __init__(self, pool: ReplicaPool[C], key: str) -> None:
        self.pool = pool
        self.key = key
        self.sessions: dict[str, Replica[C]] = {}

    def _opened(self, r: Replica[C], session_id: str) -> None:
        self.sessions[session_id] = r
        r.sessions += 1
        r.sessions_created += 1
        self.pool.events.session_created(self.pool.service, r.address)

    def _dropped(self, session_id: str) -> Replica[C] | None:
        r = self.sessions.pop(session_id, None)
        if r is not None:
            r.sessions -= 1
        return r

    def _abandon(self, session_id: str) -> None:
        """Forgets a session after an error that may have left it alive on
        its replica (a transient UNAVAILABLE, a broken stream) and releases
        it there in the background: nothing is left for the TTL."""
        r = self._dropped(session_id)
        if r is not None:
            self.pool.release_later(r, session_id, self.RELEASE_TIMEOUT_S)

    def _replica(self, session_id: str) -> Replica[C]:
        r = self.sessions.get(session_id)
        if r is None:
            raise NotFound(f"{self.pool.service}: session {session_id} is not held by any replica")
        return r

    async def release(self, session_id: str, timeout: float | None) -> None:
        r = self._dropped(session_id)
        if r is not None:
            await self.pool.call(r, lambda c: c.release(session_id, timeout))


class RoutedTarget(_Bound[Any]):
    """``TargetClient`` for one request: sessions by bounded-load hashing on
    the request key; a session's calls go to the replica holding its cache.
    A failed replica surfaces as UNAVAILABLE or NOT_FOUND, and the decode
    loop's rebuild (a Prefill) lands on the next replica that runs the same
    numerics as the request's first session (calibration is per node: a
    replica on other numerics could continue the text differently), or
    fails UNAVAILABLE when there is none."""

    def __init__(self, pool: ReplicaPool[Any], key: str) -> None:
        super().__init__(pool, key)
        self.numerics: str | None = None  # of the first session's replica; None before it

    def _order(self) -> list[Replica[Any]]:
        order = self.pool.target_order(self.key)
        if self.numerics is None or not self.numerics:  # the first session (or numerics never learned)
            return order
        same = [r for r in order if r.numerics == self.numerics]
        if not same:
            raise Unavailable(
                f"no target replica runs this request's numerics ({self.numerics}) to rebuild its session on "
                f"(others: {', '.join(sorted({r.numerics or '?' for r in order})) or 'none'}); "
                "a rebuild on other numerics could change the output"
            )
        return same

    async def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int, timeout: float | None,
        options: SessionOptions | None = None,
    ) -> PrefillReply:
        r, reply = await self.pool.first_create(
            self._order(),
            lambda c, sid: c.prefill(token_ids, cfg, sample_next, rng_offset, timeout, options, session_id=sid),
            self.RELEASE_TIMEOUT_S,
        )
        if self.numerics is None:
            self.numerics = r.numerics
        self._opened(r, reply.session_id)
        return reply

    async def verify(
        self,
        session_id: str,
        cache_len: int,
        new_ids: Sequence[int],
        draft_ids: Sequence[int],
        q: Sequence[SparseQ],
        timeout: float | None,
        post: PostToken | None = None,
        ahead: int = 0,
        stop_ids: Collection[int] = (),
        ahead_lookup: int = 0,
    ) -> VerifyReply:
        r = self._replica(session_id)
        try:
            return await self.pool.call(
                r, lambda c: c.verify(session_id, cache_len, new_ids, draft_ids, q, timeout, post, ahead, stop_ids,
                                        ahead_lookup)
            )
        except NotFound:
            self._dropped(session_id)  # the cache is gone with it; the caller rebuilds
            raise
        except Unavailable:
            self._abandon(session_id)  # maybe only the call was lost: release what may still live there
            raise


class RoutedDraft(_Bound[Any]):
    """``DraftClient`` for one request: the session is created on the less
    loaded of two random replicas. A replica that fails reports the session
    lost (NOT_FOUND), so the decode loop recreates it on another replica."""

    async def create(self, cfg: SamplingConfig, drafter: str, timeout: float | None, rng_offset: int = 0,
                     options: SessionOptions | None = None) -> str:
        r, sid = await self.pool.first_create(
            self.pool.draft_order(),
            lambda c, name: c.create(cfg, drafter, timeout, rng_offset, options, session_id=name),
            self.RELEASE_TIMEOUT_S,
        )
        self._opened(r, sid)
        return str(sid)

    async def propose(
        self,
        session_id: str,
        base_len: int,
        new_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float,
        timeout: float | None,
    ) -> ProposeReply:
        r = self._replica(session_id)
        try:
            return await self.pool.call(
                r, lambda c: c.propose(session_id, base_len, new_ids, num_tokens, min_confidence, timeout)
            )
        except NotFound:
            self._dropped(session_id)
            raise
        except Unavailable as e:
            self._abandon(session_id)
            raise NotFound(f"draft replica {r.address} failed: {e.message}") from None

    async def open_stream(
        self,
        cfg: SamplingConfig,
        drafter: str,
        rng_offset: int,
        token_ids: Sequence[int],
        draft_until: int,
        min_confidence: float,
        timeout: float | None,
        options: SessionOptions | None = None,
    ) -> Any:
        """A draft Session stream on the less loaded of two random replicas;
        it counts as one of that replica's sessions until ``stream_closed``."""
        r, stream = await self.pool.first_success(
            self.pool.draft_order(),
            lambda c: c.open_stream(cfg, drafter, rng_offset, token_ids, draft_until, min_confidence, timeout,
                                    options),
        )
        self._opened(r, stream.session_id)
        return stream

    def stream_closed(self, session_id: str, error: str = "") -> None:
        """The stream ended; with ``error`` (the replica failed it) the
        replica is backed off, so the next stream goes elsewhere."""
        r = self._dropped(session_id)
        if r is not None and error:
            self.pool.mark_failed(r, error)

    def fault(self, session_id: str, error: str) -> None:
        """The target refused what this session's replica drafted: back the
        replica off, so new sessions go elsewhere for a while (the caller
        releases the session)."""
        r = self.sessions.get(session_id)
        if r is not None:
            self.pool.mark_failed(r, error)


class Router(Generic[C]):
    """A pool plus the per-request client factory the servicer uses."""

    def __init__(self, pool: ReplicaPool[C], bound: type[_Bound[Any]]) -> None:
        self.pool = pool
        self._bound = bound

    def bind(self, key: str) -> Any:
        return self._bound(self.pool, key)

    async def info(self, timeout: float | None = None, drafter: str = "") -> Any:
        return await self.pool.info(timeout, drafter)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()
