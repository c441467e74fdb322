"""gRPC implementations of the decode loop's ``TargetClient`` and ``DraftClient``."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Collection, Sequence

import grpc
import numpy as np

from orchestrator.protocols import PostToken, PrefillReply, ProposeReply, SessionOptions, VerifyReply
from specdec.draft_chain import ChainPause, ChainToken
from specdec.errors import DeadlineExceeded, FailedPrecondition, SpecdecError, Unavailable, from_rpc_error
from specdec.grpc_util import channel_options
from specdec.tls import TlsClientConfig, aio_channel
from specdec.sampling import SamplingConfig, SparseQ, TokenLogprob
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def sampling_proto(cfg: SamplingConfig) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    if cfg.seed is not None:
        msg.seed = cfg.seed
    return msg


def logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprobs]) -> list[TokenLogprob]:
    return [TokenLogprob(m.chosen.token_id, m.chosen.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in msgs]


def set_grammar(req: Any, opts: SessionOptions) -> None:
    """Structured output on a Prefill, CreateDraftSession or DraftOpen request."""
    if opts.grammar is not None:
        opts.grammar.to_proto(req.grammar)
        req.grammar_start = opts.grammar_start


def make_channel(address: str, max_message_bytes: int, tls: TlsClientConfig | None = None) -> grpc.aio.Channel:
    return aio_channel(address, tls, channel_options(max_message_bytes))


class _GrpcClient:
    """Calls one service and maps its RpcErrors onto domain errors."""

    service = ""

    def __init__(self, stub: Any) -> None:
        self.stub = stub

    async def _rpc(self, method: str, request: Any, timeout: float | None) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.service) from None

    async def info(self, timeout: float | None = None, drafter: str = "") -> common_pb2.ModelInfo:
        return await self._rpc("GetModelInfo", common_pb2.ModelInfoRequest(drafter=drafter), timeout)

    async def release(self, session_id: str, timeout: float | None) -> None:
        await self._rpc("Release", common_pb2.ReleaseRequest(session_id=session_id), timeout)


class GrpcTargetClient(_GrpcClient):
    """The target's client. With ``verify_stream``, each session's Verify
    calls go over one ``VerifyStream`` call (opened at the session's first
    verify, closed by ``release`` or by the first error, which ends it on the
    server too); a target without that method (UNIMPLEMENTED) is called with
    unary Verify from then on.

    Decode-ahead (``verify(..., ahead=n)``, streams only): a plain round asks
    the target to go on decoding n more plain steps by itself
    (VerifyRequest.decode_ahead); the replies arrive on the stream while the
    caller is still handling the previous token. A later plain round that
    continues exactly where the last reply left off (its cache length, its
    next token as the one new token) takes the next reply off the stream
    instead of sending a request: the same reply the request would have got,
    without its round trip. A round that asks anything else first drops the
    stream (the target's run stops with it)."""

    service = "target"

    def __init__(self, channel: grpc.aio.Channel, verify_stream: bool = False) -> None:
        super().__init__(target_pb2_grpc.TargetStub(channel))
        self.verify_stream = verify_stream
        self._streams: dict[str, Any] = {}  # session id -> its open VerifyStream call
        # session id -> (cache_len, next token) the decode-ahead run on its stream continues from
        self._ahead: dict[str, tuple[int, int]] = {}

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def _close_stream(self, session_id: str) -> None:
        self._ahead.pop(session_id, None)
        call = self._streams.pop(session_id, None)
        if call is not None:
            call.cancel()

    async def release(self, session_id: str, timeout: float | None) -> None:
        self._close_stream(session_id)
        await super().release(session_id, timeout)

    def _background_release(self, session_id: str) -> None:
        task = asyncio.ensure_future(self.release(session_id, 5.0))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _verify_rpc(self, session_id: str, req: target_pb2.VerifyRequest | None, timeout: float | None) -> Any:
        """One Verify exchange; ``req`` None: the next decode-ahead reply
        already on its way (nothing is sent)."""
        if not self.verify_stream:
            assert req is not None
            return await self._rpc("Verify", req, timeout)
        call = self._streams.get(session_id)
        if call is None:
            assert req is not None
            call = self._streams[session_id] = self.stub.VerifyStream()

        async def exchange() -> Any:
            try:
                if req is not None:
                    await call.write(req)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INTERNAL and _CORE_WRITE_FAILURE in (e.details() or ""):
                    # grpc's own status for a message it could not send (the
                    # connection is gone): the target never saw this request
                    raise Unavailable(f"{self.service}: the Verify stream's connection is gone") from None
                raise
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise Unavailable(f"{self.service}: the Verify stream ended without a reply")
            return reply

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except BaseException as e:
            self._close_stream(session_id)  # after any failure, cancellation included, its state is unknown
            if isinstance(e, grpc.RpcError):
                if e.code() == grpc.StatusCode.UNIMPLEMENTED and req is not None:  # an older target: unary now on
                    self.verify_stream = False
                    return await self._rpc("Verify", req, timeout)
                raise from_rpc_error(e, self.service) from None
            if isinstance(e, asyncio.TimeoutError):
                raise DeadlineExceeded(f"{self.service}: no Verify reply on the stream within {timeout:.3g} s") from None
            if isinstance(e, Exception) and not isinstance(e, SpecdecError):  # e.g. a write on an ended call
                raise Unavailable(f"{self.service}: the Verify stream failed: {type(e).__name__}: {e}") from None
            raise

    async def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int, timeout: float | None,
        options: SessionOptions | None = None, session_id: str = "",
    ) -> PrefillReply:
        """``session_id``: the id to give the new session ("" = the target
        picks one); the reply's id is the one to use (an older target
        ignores the request's)."""
        opts = options or SessionOptions()
        req = target_pb2.PrefillRequest(
            token_ids=token_ids, sampling=sampling_proto(cfg), sample_next_token=sample_next, rng_offset=rng_offset,
            return_logprobs=opts.top_logprobs >= 0, top_logprobs=max(0, opts.top_logprobs), session_id=session_id,
        )
        set_grammar(req, opts)
        r = await self._rpc("Prefill", req, timeout)
        if opts.grammar is not None and not r.grammar_applied:
            self._background_release(r.session_id)
            raise FailedPrecondition("target: this replica does not support structured output (an older version)")
        return PrefillReply(
            r.session_id,
            r.next_token_id if r.has_next_token else None,
            r.next_token_logit_gap,
            r.cache_len,
            r.timings.compute_ms,
            logprobs_from_proto([r.next_token_logprobs]) if r.HasField("next_token_logprobs") else [],
            r.grammar_dead_end,
            r.cached_prompt_tokens,
        )

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
        """``ahead``/``stop_ids``: decode-ahead for a plain round (see the
        class); ignored for a round with a drafted span or without a stream.
        ``ahead_lookup``: the run's steps may verify the target's own lookup
        span of at most this many tokens; ``ahead`` then counts tokens."""
        plain = not draft_ids and post is None
        pending = self._ahead.pop(session_id, None)
        req: target_pb2.VerifyRequest | None = None
        if pending is not None and not (plain and pending == (cache_len, *new_ids)):
            self._close_stream(session_id)  # the run ahead is not what this round asks: stop it
            pending = None
        if pending is None:
            req = target_pb2.VerifyRequest(
                session_id=session_id,
                cache_len=cache_len,
                new_token_ids=new_ids,
                draft_token_ids=draft_ids,
                draft_probs=[common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=p.tolist()) for ids, p in q],
            )
            if post is not None:
                req.has_post_token = True
                req.post_token_id = post[0]
                if post[1] is not None:
                    req.post_prob.token_ids.extend(post[1][0].tolist())
                    req.post_prob.probs.extend(post[1][1].tolist())
            if plain and ahead > 0 and self.verify_stream:
                req.decode_ahead = ahead
                req.stop_token_ids.extend(sorted(stop_ids))
                req.ahead_lookup_tokens = max(0, ahead_lookup)
        r = await self._verify_rpc(session_id, req, timeout)
        if r.ahead_left and self.verify_stream:
            self._ahead[session_id] = (r.cache_len, r.next_token_id)
        return VerifyReply(
            r.num_accepted,
            r.next_token_id,
            r.cache_len,
            list(r.logit_gaps),
            r.timings.compute_ms,
            r.timings.queue_ms,
            r.queue_depth,
            r.timings.batch_size or 1,
            r.timings.batch_tokens,
            r.next_is_post,
            logprobs_from_proto(r.logprobs),
            r.grammar_dead_end,
            list(r.self_drafted_token_ids),
            int(r.ahead_left) if self.verify_stream else 0,
        )



#: the details grpc aio gives a stream write that its core could not send
#: (``grpc/aio/_call.py`` ``_write``: a lost connection, not a server's status)
_CORE_WRITE_FAILURE = "Internal error from Core"


def _q(d: common_pb2.SparseDistribution) -> SparseQ:
    return np.asarray(d.token_ids, dtype=np.int64), np.asarray(d.probs, dtype=np.float32)


def _stream_token(t: draft_pb2.DraftedToken, received: float) -> ChainToken:
    return ChainToken(t.position, t.version, t.token_id, _q(t.prob), t.confidence, t.compute_ms, received)


def _stream_pause(e: draft_pb2.DraftPaused) -> ChainPause:
    return ChainPause(e.position, e.version, e.reason, e.commit)


class GrpcDraftStream:
    """One ``Draft/Session`` call: commits are written in order, events are
    read by a background task into a buffer (so a slow consumer never blocks
    the transport and a timeout never cancels a read half-way)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.session_id = ""
        self.drafter = ""
        self._buf: collections.deque[Any] = collections.deque()
        self._signal = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def _open(self, req: draft_pb2.DraftSessionRequest, timeout: float | None) -> None:
        await self.call.write(req)
        first = await asyncio.wait_for(self.call.read(), timeout)
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "opened":
            raise Unavailable("the draft stream ended before it opened")
        self.session_id, self.drafter = first.opened.session_id, first.opened.drafter
        self._reader = asyncio.create_task(self._read())

    def _put(self, item: Any) -> None:
        self._buf.append(item)
        self._signal.set()

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    self._put(Unavailable("draft: the stream ended"))
                    return
                now = time.perf_counter()
                kind = msg.WhichOneof("kind")
                if kind == "token":
                    self._put(_stream_token(msg.token, now))
                elif kind == "paused":
                    self._put(_stream_pause(msg.paused))
                elif kind == "batch":
                    for t in msg.batch.tokens:
                        self._buf.append(_stream_token(t, now))
                    if msg.batch.HasField("paused"):
                        self._buf.append(_stream_pause(msg.batch.paused))
                    self._signal.set()
        except grpc.RpcError as e:
            self._put(from_rpc_error(e, "draft"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # pragma: no cover - defensive
            self._put(Unavailable(f"draft: stream reader failed: {e!r}"))

    async def commit(self, version: int, token_ids: Sequence[int], draft_until: int, min_confidence: float) -> None:
        req = draft_pb2.DraftSessionRequest(commit=draft_pb2.DraftCommit(
            token_ids=token_ids, version=version, draft_until=draft_until, min_confidence=min_confidence))
        try:
            await self.call.write(req)
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            raise Unavailable(f"draft: the stream is closed: {e}") from None

    def ready(self) -> list[ChainToken | ChainPause]:
        """Every event received so far (non-blocking). Raises the stream's
        error (a SpecdecError) once it ended, after the events before it."""
        out: list[ChainToken | ChainPause] = []
        while self._buf:
            item = self._buf[0]
            if isinstance(item, SpecdecError):
                if out:
                    break
                raise item  # stays in the buffer: the stream stays ended
            out.append(self._buf.popleft())
        if not self._buf:
            self._signal.clear()
        return out

    async def wait(self, timeout: float) -> None:
        """Until an event is ready; DeadlineExceeded after ``timeout`` s."""
        if self._buf:
            return
        self._signal.clear()
        try:
            await asyncio.wait_for(self._signal.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"draft: no event for {timeout:.3f} s") from None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.call.cancel()


class GrpcDraftClient(_GrpcClient):
    service = "draft"

    def __init__(self, channel: grpc.aio.Channel, batch_events: bool = True) -> None:
        """``batch_events``: ask draft streams for one message per batch of
        ready events (``DraftOpen.batch_events``); False asks for one per
        event, as a caller that predates batches does."""
        super().__init__(draft_pb2_grpc.DraftStub(channel))
        self.batch_events = batch_events

    async def create(self, cfg: SamplingConfig, drafter: str, timeout: float | None, rng_offset: int = 0,
                     options: SessionOptions | None = None, session_id: str = "") -> str:
        """The new session's id: ``session_id`` when given (an older draft
        ignores it and picks its own)."""
        req = draft_pb2.CreateDraftSessionRequest(sampling=sampling_proto(cfg), drafter=drafter, rng_offset=rng_offset,
                                                  session_id=session_id)
        set_grammar(req, options or SessionOptions())
        r = await self._rpc("CreateSession", req, timeout)
        return r.session_id

    async def propose(
        self,
        session_id: str,
        base_len: int,
        new_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float,
        timeout: float | None,
    ) -> ProposeReply:
        req = draft_pb2.ProposeRequest(
            session_id=session_id,
            base_len=base_len,
            new_token_ids=new_ids,
            num_tokens=num_tokens,
            min_confidence=min_confidence,
        )
        r = await self._rpc("Propose", req, timeout)
        q = [_q(d) for d in r.probs]
        return ProposeReply(list(r.token_ids), q, r.committed_len, r.timings.compute_ms, list(r.confidence),
                            cached_tokens=r.cached_prompt_tokens)

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
    ) -> GrpcDraftStream:
        """Opens a ``Draft/Session`` stream (no deadline: it lives as long as
        the generation; ``timeout`` bounds the open)."""
        stream = GrpcDraftStream(self.stub.Session())
        req = draft_pb2.DraftSessionRequest(open=draft_pb2.DraftOpen(
            sampling=sampling_proto(cfg), drafter=drafter, rng_offset=rng_offset, token_ids=token_ids,
            draft_until=draft_until, min_confidence=min_confidence, batch_events=self.batch_events))
        set_grammar(req.open, options or SessionOptions())
        try:
            await stream._open(req, timeout)
        except grpc.RpcError as e:
            await stream.close()
            raise from_rpc_error(e, self.service) from None
        except asyncio.TimeoutError:
            await stream.close()
            raise DeadlineExceeded("the draft stream did not open in time") from None
        except BaseException:
            await stream.close()
            raise
        return stream



class GrpcEndpoint:
    """One replica for ``orchestrator.routing``: its channel, client and health check."""

    def __init__(self, channel: grpc.aio.Channel, client: Any) -> None:
        self.channel = channel
        self.client = client

    async def check(self, timeout: float) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self.channel.close()
