"""The per-request speculative decoding loop: prefill → propose → verify →
commit, with fallback to target-only rounds when the draft fails and session
rebuilds when the target loses one. The span comes from a Propose call per
round (``unary``) or from the request's draft stream (``stream``,
``run-ahead``: ``specdec/draft_chain.py`` ``ChainTracker`` decides which streamed tokens may
be verified; docs/architecture.md "Draft streams and run-ahead").

The loop talks to the services through the ``TargetClient`` and ``DraftClient``
protocols (orchestrator/protocols.py), so it runs without gRPC. It holds the
authoritative token sequence (``committed``); the services' KV caches are caches of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from orchestrator.decode_params import (  # noqa: F401  (re-exported: the loop's public types)
    DRAFT_MODES, DRAFT_S_PER_TOKEN, MAX_REBUILDS_PER_ROUND, PREFILL_S_PER_TOKEN, DecodeParams, Step, UnknownDrafter,
)
from orchestrator.draft_window import DraftFeed, plan_feed
from orchestrator.policy import RoundObservation
from orchestrator.request_stats import RequestStats
from orchestrator.protocols import DraftClient, DraftStream, PostToken, ProposeReply, TargetClient, VerifyReply
from specdec.draft_chain import ChainToken, ChainTracker, StreamFault
from specdec.errors import (
    DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, SpecdecError, Unavailable,
)
from specdec.logging_util import log
from specdec.sampling import SparseQ, one_hot_q

logger = logging.getLogger("specdec.orchestrator")


class Decoder:
    """One request's decoding state and loop."""

    def __init__(self, target: TargetClient, draft: DraftClient | None, params: DecodeParams) -> None:
        self.target = target
        self.draft = draft if params.speculate else None
        self.p = params
        self.committed: list[int] = list(params.prompt_ids)
        self.stats = RequestStats(prompt_tokens=len(params.prompt_ids))
        self.target_sid: str | None = None
        self.target_cache_len = 0
        self.draft_sid: str | None = None
        self.draft_sessions = 0  # draft sessions created so far: the next one's rng_offset
        self.draft_known = 0  # committed tokens the draft session knows
        self.draft_skip = 0  # ... less the committed tokens [sink, sink + skip) its context window left out
        self._fed_tokens = 0  # committed tokens the last Propose fed the draft
        self.draft_down_until_round = 0
        self._draft_wall_ms = 0.0
        self._tasks: set[asyncio.Future[Any]] = set()  # fire-and-forget releases
        self.stats.draft_mode = params.draft_mode if self.draft is not None else "unary"
        self.streamed = self.draft is not None and params.draft_mode != "unary"
        self.stream: DraftStream | None = None
        self.tracker = ChainTracker()
        self.stream_version = 0  # the last commit version sent on the stream (the open is 0)
        self.stream_known = 0  # committed tokens the stream has been sent
        self.stream_drafted = 0  # committed tokens the stream had drafted after at its last span
        self._warm: asyncio.Future[None] | None = None  # the draft's overlapped prompt prefill (draft_prefill_overlap)
        self.lookup = params.lookup if (self.draft is not None and not self.streamed) else None  # unary only
        self._local: list[int] = []  # this round's prompt-lookup span (orchestrator/lookup.py), if it has one
        self._ahead_lookup = self._run_left = 0  # a run's own-span cap; the last reply's ahead_left (a run is on its way)

    # --------------------------------------------------------------- helpers
    def _prefill_timeout(self, tokens: int) -> float:
        """A prefill's own cap: ``target_timeout_s`` plus 120 ms a prompt token (a 4,000-token
        prompt chunked beside busy streams outlasts 120 s); the request's deadline still bounds it."""
        return self.p.target_timeout_s + PREFILL_S_PER_TOKEN * tokens

    def _draft_timeout(self, tokens: int) -> float:
        """A draft call's own cap: ``draft_timeout_s`` plus 10 ms a context
        token it takes in before drafting (its catch-up prefill, chunked on
        the draft, which keeps what it fed if the call is given up)."""
        return self.p.draft_timeout_s + DRAFT_S_PER_TOKEN * max(0, tokens)

    def _timeout(self, cap: float) -> float:
        if self.p.deadline is None:
            return cap
        remaining = self.p.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("request deadline exceeded")
        return min(cap, remaining)

    @property
    def generated(self) -> int:
        return len(self.committed) - len(self.p.prompt_ids)

    async def _rebuild_target(self, release_old: bool = False) -> None:
        """Recreates a lost (or out-of-step, ``release_old``) target session
        from the committed tokens: the last committed token stays pending (it
        is sent as the next round's delta)."""
        self.stats.target_rebuilds += 1
        if self.p.sink is not None:
            self.p.sink.on_rebuild()
        old = self.target_sid
        self.target_sid = None
        if release_old and old is not None:
            self._background(self.target.release(old, self.p.release_timeout_s))
        log(logger, logging.WARNING, "rebuilding target session", old_session=old, tokens=len(self.committed))
        reply = await self.target.prefill(
            self.committed[:-1], self.p.sampling, False, len(self.committed),
            self._timeout(self._prefill_timeout(len(self.committed))),
            self.p.options,
        )
        self.target_sid = reply.session_id
        self.target_cache_len = reply.cache_len
        self.stats.verify_ms += reply.compute_ms
        self.stats.prefill_ms += reply.compute_ms

    def _check_unhosted(self) -> None:
        """The draft could not be asked (down, backed off, slow) before this
        request's first draft session: a drafter name it did not host when it
        attached is refused as the draft would have refused it, rather than
        served target-only as if it were valid."""
        name, hosted = self.p.drafter, self.p.hosted_drafters
        if name and hosted and name not in hosted and self.draft_sessions == 0:
            raise UnknownDrafter(f"speculation.drafter: unknown drafter {name!r}; available: {sorted(hosted)}")

    async def _create_draft(self) -> None:
        assert self.draft is not None
        try:
            self.draft_sid = await self.draft.create(
                self.p.sampling, self.p.drafter, self._timeout(self.p.draft_timeout_s), self.draft_sessions,
                self.p.draft_options,
            )
            self.draft_sessions += 1  # the next session (if this one is lost) gets a fresh stream
            self.draft_known = self.draft_skip = 0
        except InvalidArgument as e:  # e.g. an unknown drafter name: the client's error
            raise UnknownDrafter(f"speculation.drafter: {e.message}") from None
        except SpecdecError as e:
            self._check_unhosted()
            log(logger, logging.WARNING, "draft session not created; continuing target-only", error=e.message)

    async def _propose(self, gamma: int, min_confidence: float) -> ProposeReply | None:
        """Drafts up to γ tokens (fewer when a token's draft confidence falls
        below ``min_confidence``); None when the draft cannot serve this round."""
        assert self.draft is not None
        for attempt in range(2):
            try:
                if self.draft_sid is None:
                    await self._create_draft()
                    if self.draft_sid is None:
                        break
                t0 = time.perf_counter()
                feed = self._draft_feed()
                self._fed_tokens = len(feed.tokens)
                reply = await self.draft.propose(
                    self.draft_sid,
                    feed.base,
                    feed.tokens,
                    gamma,
                    min_confidence,
                    self._timeout(self._draft_timeout(self._fed_tokens)),
                )
                self._draft_wall_ms = (time.perf_counter() - t0) * 1e3
                problem = reply.problem(gamma, feed.draft_len())
                if problem:
                    self._draft_fault(problem)
                    return None
                self.draft_skip = feed.skip
                self.draft_known = reply.committed_len + feed.skip
                self.stats.draft_cached_prompt_tokens += reply.cached_tokens
                return reply
            except NotFound:
                self.draft_sid = None  # lost session: recreate from the tokens once
                if attempt == 0:
                    continue
            except UnknownDrafter:
                raise
            except SpecdecError as e:
                if self.p.deadline is not None and time.monotonic() >= self.p.deadline:
                    raise DeadlineExceeded("request deadline exceeded") from None
                # Keep the session: if the draft comes back it is reused (its
                # cache is rolled back to the committed prefix on the next call).
                log(logger, logging.WARNING, "draft failed; round runs target-only", error=str(e))
            break
        self._count_fallback()
        return None

    async def _create_draft_and_warm(self) -> None:
        """Creates the draft session; with ``draft_prefill_overlap`` then
        starts the draft's prompt prefill in the background (not awaited
        here: the target's first token never waits for it)."""
        await self._create_draft()
        if self.p.draft_prefill_overlap and self.draft_sid is not None and len(self.p.prompt_ids) > 1:
            self._warm = asyncio.ensure_future(self._warm_draft(self.draft_sid))

    async def _warm_draft(self, sid: str) -> None:
        """One Propose of a token on the prompt: the draft session takes the
        prompt in (its proposal is dropped). A failure is only logged: the
        first round's Propose takes in whatever is missing."""
        assert self.draft is not None
        feed = plan_feed(self.p.prompt_ids, 0, 0, self.p.draft_window, self.p.draft_sink)
        try:
            reply = await self.draft.propose(sid, 0, feed.tokens, 1, 0.0,
                                             self._timeout(self._draft_timeout(len(feed.tokens))))
        except SpecdecError as e:
            log(logger, logging.INFO, "draft prompt prefill not finished; the first draft round takes it in",
                error=e.message)
            return
        if self.draft_sid == sid and self.draft_known == 0 and reply.committed_len == feed.draft_len():
            self.draft_known, self.draft_skip = reply.committed_len + feed.skip, feed.skip
            self.stats.draft_cached_prompt_tokens += reply.cached_tokens
            self.stats.draft_ms += reply.compute_ms

    def _draft_feed(self) -> DraftFeed:
        """The next Propose's context (orchestrator/draft_window.py): the
        committed tokens the draft has not taken in, or, past its context
        window, its sink and the last window of them."""
        return plan_feed(self.committed, self.draft_known, self.draft_skip, self.p.draft_window, self.p.draft_sink)

    def _warming(self) -> bool:
        """The draft's overlapped prompt prefill is still running."""
        return self._warm is not None and not self._warm.done()

    def _count_fallback(self) -> None:
        """A round falls back to target-only because of the draft: count it
        and leave the draft alone for ``draft_retry_after_rounds`` rounds."""
        self.stats.draft_failures += 1
        if self.p.sink is not None:
            self.p.sink.on_fallback()
        self.draft_down_until_round = self.stats.rounds + self.p.draft_retry_after_rounds

    # ------------------------------------------------------------------ loop
    def _choose(self) -> tuple[int, float]:
        """(γ, confidence stop) for the next round, from what is known now; a round
        that verifies a prompt-lookup span (``self._local``) asks the draft for nothing."""
        self._local = []
        remaining = self.p.max_new_tokens - self.generated
        if remaining <= 0:
            return 0, 0.0
        if self.lookup is not None and self.p.lookup_policy is not None:
            self._local = self.lookup.next_span(self.committed, min(self.p.max_lookup_tokens, remaining - 1),
                                                self.p.lookup_policy)
            if self._local:
                return 0, 0.0
        if self._warming():  # the draft is still taking the prompt in: plain rounds meanwhile
            return 0, 0.0
        outlook = getattr(self.p.policy, "set_outlook", None)
        if outlook is not None and not self.streamed and self.draft is not None:
            outlook(len(self._draft_feed().tokens), remaining, self.generated)
        gamma = min(self.p.policy.next_gamma(), remaining - 1)
        return gamma, (self.p.min_confidence or self.p.policy.stop_confidence()) if gamma > 0 else 0.0

    def _ahead(self) -> int:
        """Plain rounds after this plain one that the target may decode ahead:
        all of them without a drafter, else those the policy commits to (with
        lookup, see LocalLookup.ahead_room and .grant)."""
        self._ahead_lookup = 0
        room = min(self.p.decode_ahead, self.p.max_new_tokens - self.generated - 1)
        if room <= 0 or self.draft is None:
            return max(0, room)
        if self.lookup is not None:
            room = self.lookup.ahead_room(room)
        commit = getattr(self.p.policy, "commit_plain_rounds", None)
        n = int(commit(room)) if room > 0 and commit is not None and self.stats.rounds >= self.draft_down_until_round else 0
        if self.lookup is None or self._run_left:  # a run still on its way serves the round
            return n
        n, self._ahead_lookup = self.lookup.grant(n, room, self.p.policy, self.p.lookup_policy, self.p.max_lookup_tokens)
        return n

    def _drafting(self, gamma: int) -> bool:
        return gamma > 0 and self.draft is not None and self.stats.rounds >= self.draft_down_until_round

    async def run(self) -> AsyncIterator[Step]:
        """Yields committed tokens step by step until max_new_tokens. The caller
        stops iterating on EOS or stop strings; ``close()`` releases sessions."""
        # The draft session is created (or its stream opened) while the target
        # prefills, so an unknown drafter fails the request before any token
        # is streamed.
        draft_task = None
        if self.draft is not None:
            draft_task = asyncio.create_task(self._open_stream(0) if self.streamed else self._create_draft_and_warm())
        try:
            reply = await self.target.prefill(
                self.p.prompt_ids, self.p.sampling, True, 0, self._timeout(self._prefill_timeout(len(self.p.prompt_ids))),
                self.p.options
            )
            self.target_sid, self.target_cache_len = reply.session_id, reply.cache_len
            self.stats.cached_prompt_tokens = reply.cached_tokens
        finally:
            if draft_task is not None:
                await draft_task
        self.stats.verify_ms += reply.compute_ms
        self.stats.prefill_ms += reply.compute_ms
        if reply.dead_end:  # structured output: the grammar allows no first token
            yield Step([], [], [], dead_end=True)
            return
        assert reply.next_token is not None
        self.committed.append(reply.next_token)
        self.stats.first_token_at = time.perf_counter()
        gamma, min_conf = self._choose()
        await self._stream_commit(gamma, min_conf)
        round_start = time.perf_counter()
        yield Step([reply.next_token], [reply.logit_gap], reply.logprobs)

        self._continued = False  # the previous round's whole span was accepted
        while self.generated < self.p.max_new_tokens:
            proposal: ProposeReply | None = None
            self._draft_wall_ms = 0.0
            local = self._local
            if local:
                proposal = ProposeReply(list(local), one_hot_q(local), self.draft_known, 0.0)
            elif self._drafting(gamma):
                if self.streamed:
                    proposal = await self._stream_span(gamma, min_conf)
                else:
                    proposal = await self._propose(gamma, min_conf)
                if proposal is not None:
                    self.stats.draft_ms += proposal.compute_ms
                    if self.streamed:
                        self._draft_wall_ms = proposal.waited_ms
                        self.stats.draft_hidden_ms += max(0.0, proposal.compute_ms - proposal.exposed_ms)
                    else:
                        self.stats.rtt_ms += max(0.0, self._draft_wall_ms - proposal.compute_ms)
            draft_ids = proposal.token_ids if proposal else []
            sampled = not self.p.sampling.greedy
            q = proposal.q if (proposal and sampled) else []
            post: PostToken | None = None
            if proposal is not None and proposal.post is not None:
                post = (proposal.post[0], proposal.post[1] if sampled else None)
            tokens_in_pass = len(self.committed) - self.target_cache_len + len(draft_ids)
            t0 = time.perf_counter()
            empty = proposal is not None and not draft_ids  # the drafter had nothing to propose
            verified, draft_ids = await self._verify(draft_ids, q, post, self._ahead() if proposal is None else 0)
            if not draft_ids and not empty:
                proposal = None  # the target refused the draft's part: this round ran target-only
            done = time.perf_counter()
            verify_wall_ms = (done - t0) * 1e3
            self.stats.rtt_ms += max(0.0, verify_wall_ms - verified.compute_ms - verified.queue_ms)
            exposed = 0.0
            if proposal is not None:
                exposed = proposal.exposed_ms if self.streamed else proposal.compute_ms
            self.stats.round_overhead_ms.append(
                max(0.0, (done - round_start) * 1e3 - verified.compute_ms - verified.queue_ms - exposed)
            )
            self._record(len(draft_ids) if verified.drafted else len(local) if local else gamma, proposal, draft_ids,
                         verified, verify_wall_ms, tokens_in_pass + len(verified.drafted),
                         local=bool(local or verified.drafted))
            new = draft_ids[: verified.num_accepted] + ([] if verified.dead_end else [verified.next_token])
            self.stats.committed_in_rounds += len(new)
            self.committed.extend(new)
            if verified.dead_end:
                yield Step(new, verified.logit_gaps, verified.logprobs, dead_end=True)
                return
            gamma, min_conf = self._choose()
            await self._stream_commit(gamma, min_conf)
            round_start = time.perf_counter()
            yield Step(new, verified.logit_gaps, verified.logprobs)

    def _record(
        self, gamma: int, proposal: ProposeReply | None, draft_ids: list[int], verified: VerifyReply,
        verify_wall_ms: float, tokens_in_pass: int, local: bool = False,
    ) -> None:
        """Counts a verified round and shows it to the policy and the metrics
        (a local prompt-lookup round: to its own policy and label)."""
        self.stats.rounds += 1
        self.stats.draft_tokens += len(draft_ids)
        self.stats.accepted_tokens += verified.num_accepted
        self.stats.post_verified += int(verified.is_post)
        self.stats.gamma_trajectory.append(len(draft_ids))
        self.stats.accepted_per_round.append(verified.num_accepted)
        obs = RoundObservation(
            gamma=len(draft_ids),
            accepted=verified.num_accepted,
            draft_ms=self._draft_wall_ms if proposal else 0.0,
            draft_compute_ms=proposal.compute_ms if proposal else 0.0,
            verify_ms=verify_wall_ms,
            verify_compute_ms=verified.compute_ms,
            verify_queue_ms=verified.queue_ms,
            tokens_in_pass=tokens_in_pass,
            queue_depth=verified.queue_depth,
            continued=self._continued,
            batch_size=verified.batch_size,
            batch_tokens=verified.batch_tokens,
            requested=gamma if proposal else 0,
            streamed=self.streamed,
            fed_tokens=self._fed_tokens if (proposal and not local) else 0,
        )
        self._continued = 0 < len(draft_ids) == verified.num_accepted
        if local:
            self.stats.count_lookup_round(len(draft_ids))
        (self.p.lookup_policy if local and self.p.lookup_policy is not None else self.p.policy).observe(obs)
        if self.p.sink is not None:
            self.p.sink.on_round(obs, self.p.lookup_label if local else self.p.drafter_label)

    # -------------------------------------------------------- draft stream
    def _draft_until(self, gamma: int) -> int:
        """The stream's credit for a round of γ after the committed tokens."""
        if not self._drafting(gamma):
            return len(self.committed)  # nothing to draft
        # run-ahead drafts the post-verify token and about one more span: a
        # longer run is rarely verified (a rejection drops it) and competes
        # with the verify for memory bandwidth
        ahead = min(self.p.run_ahead_tokens, gamma + 1) if self.p.draft_mode == "run-ahead" else 0
        return len(self.committed) + gamma + ahead

    async def _open_stream(self, gamma: int, min_conf: float = 0.0) -> None:
        """Opens the draft stream on the committed tokens (a failure leaves
        the request target-only for a while, like a failed Propose)."""
        assert self.draft is not None
        try:
            self.stream = await self.draft.open_stream(
                self.p.sampling, self.p.drafter, self.draft_sessions, list(self.committed), self._draft_until(gamma),
                min_conf, self._timeout(self.p.draft_timeout_s), self.p.draft_options,
            )
        except InvalidArgument as e:
            raise UnknownDrafter(f"speculation.drafter: {e.message}") from None
        except SpecdecError as e:
            self._check_unhosted()
            log(logger, logging.WARNING, "draft stream not opened; continuing target-only", error=e.message)
            return
        self.draft_sessions += 1  # a stream opened later draws a fresh random stream
        self.tracker = ChainTracker()
        self.stream_version = 0
        self.tracker.sent(0, len(self.committed))
        self.stream_known = len(self.committed)
        self.stream_drafted = 0

    async def _stream_commit(self, gamma: int, min_conf: float) -> None:
        """Sends the stream the tokens committed since the last message and
        the credit for the next round (before the step is handed to the
        client, so the draft works while the client is served)."""
        if self.stream is None:
            return
        self.stream_version += 1
        self.tracker.sent(self.stream_version, len(self.committed))
        try:
            await self.stream.commit(self.stream_version, self.committed[self.stream_known:], self._draft_until(gamma),
                                     min_conf)
        except SpecdecError as e:
            self._drop_stream(f"draft stream commit failed: {e.message}", fault=False,
                              back_off=not isinstance(e, ResourceExhausted))
            return
        self.stream_known = len(self.committed)

    async def _stream_span(self, gamma: int, min_conf: float) -> ProposeReply | None:
        """Waits until the stream's chain holds the round's span (γ tokens,
        or fewer at a confidence stop or a pause) after the committed tokens.
        None when the draft cannot serve this round: the stream failed,
        stalled past ``draft_timeout_s``, or sent something no honest draft
        sends (a draft fault)."""
        if self.stream is None:
            await self._open_stream(gamma, min_conf)
            if self.stream is None:
                self._count_fallback()
                return None
        t0 = time.perf_counter()
        # the first span after an open (or a long commit) includes the stream's catch-up prefill
        stall = self._timeout(self._draft_timeout(len(self.committed) - self.stream_drafted))
        try:
            while True:
                for ev in self.stream.ready():
                    if isinstance(ev, ChainToken):
                        self.tracker.on_token(ev)
                    else:
                        self.tracker.on_pause(ev)
                span = self.tracker.span(self.committed, gamma, min_conf)
                if span.complete:
                    break
                await self.stream.wait(stall - (time.perf_counter() - t0))
        except StreamFault as e:
            self._drop_stream(str(e), fault=True)
            return None
        except DeadlineExceeded:
            if self.p.deadline is not None and time.monotonic() >= self.p.deadline:
                raise
            self._drop_stream(f"draft stream stalled: no span within {stall:.3f} s", fault=False)
            return None
        except SpecdecError as e:
            # RESOURCE_EXHAUSTED (the draft's KV budget) says nothing of the replica's health: no backoff
            self._drop_stream(f"draft stream failed: {e.message}", fault=False,
                              back_off=not isinstance(e, ResourceExhausted))
            return None
        self.stream_drafted = len(self.committed)
        tokens = span.tokens
        post = (span.post.token_id, span.post.q) if span.post is not None and tokens else None
        return ProposeReply(
            [t.token_id for t in tokens], [t.q for t in tokens], len(self.committed),
            sum(t.compute_ms for t in tokens), [t.confidence for t in tokens], post,
            waited_ms=(time.perf_counter() - t0) * 1e3,
            exposed_ms=sum(t.compute_ms for t in tokens if t.received >= t0),
        )

    def _drop_stream(self, error: str, fault: bool, back_off: bool = True) -> None:
        """Closes a failed (or faulty) stream and runs target-only rounds for
        ``draft_retry_after_rounds`` rounds; a later round opens a new one.
        ``back_off``: the stream's replica is backed off."""
        log(logger, logging.WARNING, "draft stream dropped; rounds run target-only", error=error, fault=fault)
        self._count_fallback()
        self._close_stream(error if back_off else "")

    def _detach_stream(self, error: str = "") -> DraftStream | None:
        """Forgets the stream (its replica backed off when ``error``); the
        caller closes it, which ends the draft session."""
        stream, self.stream = self.stream, None
        closed = getattr(self.draft, "stream_closed", None)
        if stream is not None and closed is not None:
            closed(stream.session_id, error)
        return stream

    def _close_stream(self, error: str = "") -> None:
        stream = self._detach_stream(error)
        if stream is not None:
            self._background(stream.close())

    async def _verify(
        self, draft_ids: list[int], q: list[SparseQ], post: PostToken | None = None, ahead: int = 0
    ) -> tuple[VerifyReply, list[int]]:
        """Verifies the round; returns the reply and the drafted ids it verified
        (empty when the target refused the draft's part). NOT_FOUND (session
        lost), UNAVAILABLE (replica gone or draining), FAILED_PRECONDITION (out
        of step): the session is rebuilt from the tokens, on another replica if
        any. INVALID_ARGUMENT with a span: a draft fault (docs/design.md §5), the
        round redone with γ = 0; without a span it is the request's own error."""
        attempt = 0
        while True:
            assert self.target_sid is not None
            try:
                reply = await self.target.verify(
                    self.target_sid,
                    self.target_cache_len,
                    self.committed[self.target_cache_len :],
                    draft_ids,
                    q,
                    self._timeout(self.p.target_timeout_s),
                    post,
                    ahead,
                    self.p.stop_token_ids,
                    self._ahead_lookup if ahead else 0,
                )
            except InvalidArgument as e:
                if not draft_ids:
                    raise
                self._draft_fault(f"the target refused the drafted span: {e.message}")
                draft_ids, q, post = [], [], None
                continue
            except (NotFound, Unavailable, FailedPrecondition) as e:
                if attempt == MAX_REBUILDS_PER_ROUND:
                    raise Unavailable(f"target session lost {attempt + 1} times in one round: {e.message}") from None
                attempt += 1
                # whatever is left of the old session is released (off the
                # critical path): only NOT_FOUND says it is gone already
                await self._rebuild_target(release_old=not isinstance(e, NotFound))
                continue
            self.target_cache_len, self._run_left = reply.cache_len, reply.ahead_left
            self.stats.verify_ms += reply.compute_ms
            return reply, draft_ids or reply.drafted  # a decode-ahead step's own lookup span

    def _draft_fault(self, error: str) -> None:
        """The draft served something the target refused: count it, drop
        (and release) its session, back its replica off, and run target-only
        rounds for ``draft_retry_after_rounds`` rounds."""
        log(logger, logging.WARNING, "draft fault; round redone target-only", error=error)
        self._count_fallback()
        if self.stream is not None:
            fault = getattr(self.draft, "fault", None)
            if fault is not None:
                fault(self.stream.session_id, error)
            self._close_stream()
            return
        sid, self.draft_sid = self.draft_sid, None
        if sid is not None and self.draft is not None:
            fault = getattr(self.draft, "fault", None)
            if fault is not None:
                fault(sid, error)
            self._background(self.draft.release(sid, self.p.release_timeout_s))

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"

    async def close(self) -> None:
        """Releases both sessions (shielded: runs even when the request was cancelled)."""
        if self._warm is not None and not self._warm.done():
            self._warm.cancel()  # the draft stops its prefill at its next chunk (and at the release)
        tasks = []
        if self.target_sid is not None:
            tasks.append(self.target.release(self.target_sid, self.p.release_timeout_s))
            self.target_sid = None
        if self.draft is not None and self.draft_sid is not None:
            tasks.append(self.draft.release(self.draft_sid, self.p.release_timeout_s))
            self.draft_sid = None
        stream = self._detach_stream()
        if stream is not None:
            tasks.append(stream.close())
        if tasks:
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, NotFound):
                    log(logger, logging.WARNING, "session release failed", error=repr(r))
