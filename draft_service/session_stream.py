"""``specdec.v1.Draft/Session``: one bidirectional stream per generation.

Three parts run per stream, all on the event loop except the drafting itself:

- the reader applies the caller's commits to the ``DraftChain`` and wakes
  the drafter;
- the drafter asks the chain for its next step, runs it on the model worker
  (inline for model-free drafters) and queues the events the chain returns;
- the response generator sends the queued events in order: one message
  per event, or, for a caller that set ``batch_events``, every event ready
  when it writes in one ``batch`` message.

The stream's session lives in the ``SessionStore`` (it counts against the
session limit and keeps a replica that drains alive until it ends) but is
never reaped for idleness: it ends with the stream, whether the caller
half-closes, cancels or the connection drops.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc

from draft_service.drafter import Proposal
from draft_service.sessions import CatchUp, DraftSession, SessionStore, grammar_state
from specdec.draft_chain import ChainPause, ChainToken, DraftChain, Step
from specdec.errors import InvalidArgument, SpecdecError, Unavailable
from specdec.grpc_util import ModelWorker, WorkTiming
from specdec.logging_util import log
from specdec.metrics import ModelServiceMetrics
from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2, draft_pb2

logger = logging.getLogger("specdec.draft.stream")

_END = object()  # the caller half-closed: the stream ends OK


def _token_proto(ev: ChainToken) -> draft_pb2.DraftedToken:
    ids, probs = ev.q
    return draft_pb2.DraftedToken(
        position=ev.position, version=ev.version, token_id=ev.token_id,
        prob=common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=probs.tolist()),
        confidence=ev.confidence, compute_ms=ev.compute_ms,
    )


def _pause_proto(ev: ChainPause) -> draft_pb2.DraftPaused:
    return draft_pb2.DraftPaused(position=ev.position, version=ev.version, reason=ev.reason, commit=ev.commit)


def event_proto(ev: ChainToken | ChainPause) -> draft_pb2.DraftSessionEvent:
    if isinstance(ev, ChainToken):
        return draft_pb2.DraftSessionEvent(token=_token_proto(ev))
    return draft_pb2.DraftSessionEvent(paused=_pause_proto(ev))


def batch_proto(events: list[ChainToken | ChainPause]) -> draft_pb2.DraftSessionEvent:
    """One ``batch`` event: tokens, then at most one pause, which ends it."""
    batch = draft_pb2.DraftEventBatch(tokens=[_token_proto(e) for e in events if isinstance(e, ChainToken)])
    if isinstance(events[-1], ChainPause):
        batch.paused.CopyFrom(_pause_proto(events[-1]))
    return draft_pb2.DraftSessionEvent(batch=batch)


@dataclass
class CatchUpTotals:
    """The chunks of one call's catch-up prefill (:class:`~draft_service.sessions.CatchUp`), added up."""

    fed: int = 0
    cached: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0

    def add(self, c: CatchUp, t: WorkTiming) -> None:
        self.fed += c.fed
        self.cached += c.cached
        self.queue_ms += t.queue_ms
        self.compute_ms += t.compute_ms

    def total(self, last: WorkTiming) -> WorkTiming:
        """The call's timing: its chunks' and the draft job's (``last``)."""
        return WorkTiming(self.queue_ms + last.queue_ms, self.compute_ms + last.compute_ms, last.queue_depth)


class SessionStream:
    """Serves one Session call. ``resolve(name)`` returns the hosted drafter
    (raising InvalidArgument / Unavailable); ``draining()`` refuses new
    streams on a replica that is shutting down."""

    def __init__(
        self,
        sessions: SessionStore,
        worker: ModelWorker,
        metrics: ModelServiceMetrics,
        resolve: Callable[[str], Any],
        draining: Callable[[], bool],
        steps: collections.Counter[str] | None = None,
        chunk_tokens: int = 0,
    ) -> None:
        """``steps``: drafting steps per drafter name (the servicer's
        ``proposals``, which counts Propose calls the same way);
        ``chunk_tokens``: a catch-up prefill's tokens per worker job (0 = one job)."""
        self.chunk_tokens = chunk_tokens
        self.steps = steps if steps is not None else collections.Counter()
        self.sessions = sessions
        self.worker = worker
        self.metrics = metrics
        self.resolve = resolve
        self.draining = draining

    async def serve(
        self, requests: AsyncIterator[draft_pb2.DraftSessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftSessionEvent]:
        session: DraftSession | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            first = await _first(requests)
            if first is None:
                return
            if first.WhichOneof("kind") != "open":
                raise InvalidArgument("the first message of a Session stream must be `open`")
            o = first.open
            cfg = SamplingConfig.from_proto(o.sampling if o.HasField("sampling") else None)
            loaded = self.resolve(o.drafter)
            if self.draining():
                raise Unavailable("the draft replica is shutting down; open the stream on another replica")
            drafter = loaded.drafter
            chain = DraftChain(
                [int(t) for t in o.token_ids], max_span=self.sessions.max_span,
                max_context=drafter.max_context_tokens, vocab_size=drafter.vocab_size,
                draft_until=int(o.draft_until), min_confidence=float(o.min_confidence),
            )
            grammar = await grammar_state(loaded.grammars, drafter.name, o)
            session = self.sessions.create(drafter, cfg, int(o.rng_offset), streamed=True, grammar=grammar)
            out: asyncio.Queue[Any] = asyncio.Queue()
            wake = asyncio.Event()
            tasks = [
                asyncio.create_task(self._read(requests, session, chain, wake, out)),
                asyncio.create_task(self._draft(session, chain, wake, out)),
            ]
            yield draft_pb2.DraftSessionEvent(opened=draft_pb2.DraftOpened(
                session_id=session.id, drafter=drafter.name, grammar_applied=grammar is not None))
            carry: Any = None  # an item taken while batching that ends the batch
            while True:
                if carry is not None:
                    item, carry = carry, None
                else:
                    item = await out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if not o.batch_events:
                    yield event_proto(item)
                    continue
                # everything ready now goes in one message (a pause ends it);
                # nothing waits to fill a batch
                run = [item]
                while not isinstance(run[-1], ChainPause) and not out.empty():
                    nxt = out.get_nowait()
                    if not isinstance(nxt, (ChainToken, ChainPause)):
                        carry = nxt
                        break
                    run.append(nxt)
                yield batch_proto(run)
        except SpecdecError as e:
            await context.abort(e.code, e.message)
        except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as e:  # pragma: no cover - defensive: never crash the server
            logger.exception("unhandled error in Session")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            for t in tasks:
                t.cancel()
            if session is not None:
                self.sessions.discard(session.id)

    async def _read(
        self,
        requests: AsyncIterator[draft_pb2.DraftSessionRequest],
        session: DraftSession,
        chain: DraftChain,
        wake: asyncio.Event,
        out: asyncio.Queue[Any],
    ) -> None:
        try:
            async for req in requests:
                if req.WhichOneof("kind") != "commit":
                    raise InvalidArgument("only the first message of a Session stream may be `open`")
                c = req.commit
                chain.commit(int(c.version), list(c.token_ids), int(c.draft_until), float(c.min_confidence))
                session.last_used = time.monotonic()
                wake.set()
            out.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad commit (InvalidArgument) or a broken stream
            out.put_nowait(e)

    async def _draft(self, session: DraftSession, chain: DraftChain, wake: asyncio.Event, out: asyncio.Queue[Any]) -> None:
        drafter = session.drafter
        try:
            while True:
                step = chain.next_step(drafter.inline)
                if step is None:
                    blocked = chain.blocked()
                    if blocked is not None:
                        out.put_nowait(blocked)
                    wake.clear()
                    await wake.wait()
                    continue
                proposal, timing = await self._run(session, step)
                session.proposals += 1
                self.steps[drafter.name] += 1
                session.last_used = time.monotonic()
                self.metrics.observe("session", len(proposal.token_ids), timing.queue_ms, timing.compute_ms)
                for ev in chain.add(step, proposal, timing.compute_ms):
                    out.put_nowait(ev)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log(logger, logging.WARNING, "draft stream failed", session=session.id, error=repr(e))
            out.put_nowait(e)

    async def _run(self, session: DraftSession, step: Step) -> tuple[Proposal, WorkTiming]:
        # NOT_FOUND once the stream's session has ended (a catch-up stops at its next chunk)
        if session.drafter.inline:
            started = time.perf_counter()
            out = self.sessions.draft_step(session, step.context, step.num_tokens)
            assert not isinstance(out, CatchUp)
            return out, WorkTiming(0.0, (time.perf_counter() - started) * 1e3)
        catch_up = CatchUpTotals()
        while True:  # a long catch-up prefill: a chunk per worker job, other sessions' calls between them
            out, timing = await self.worker.run(self.sessions.draft_step, session, step.context, step.num_tokens,
                                                0.0, self.chunk_tokens)
            if not isinstance(out, CatchUp):
                return out, catch_up.total(timing)
            catch_up.add(out, timing)


async def _first(requests: AsyncIterator[draft_pb2.DraftSessionRequest]) -> draft_pb2.DraftSessionRequest | None:
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None
