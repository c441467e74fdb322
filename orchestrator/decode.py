"""The per-request speculative decoding loop: prefill → propose → verify →
commit, with fallback to target-only rounds when the draft fails and session
rebuilds when the target loses one.

The loop talks to the services through the small ``TargetClient`` and
``DraftClient`` protocols, so it can be exercised without gRPC. The
orchestrator holds the authoritative token sequence (``committed``); the
services' KV caches are caches of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, Sequence

import numpy as np

from orchestrator.policy import DraftLengthPolicy, RoundObservation
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, SpecdecError, Unavailable
from specdec.logging_util import log
from specdec.sampling import SamplingConfig

logger = logging.getLogger("specdec.orchestrator")

SparseQ = tuple[np.ndarray, np.ndarray]
MAX_REBUILDS_PER_ROUND = 2  # target session rebuilds (another replica each) before a round gives up


# ----------------------------------------------------------------- protocols
@dataclass(frozen=True)
class PrefillReply:
    session_id: str
    next_token: int | None
    logit_gap: float
    cache_len: int
    compute_ms: float


@dataclass(frozen=True)
class VerifyReply:
    num_accepted: int
    next_token: int
    cache_len: int
    logit_gaps: list[float]
    compute_ms: float
    queue_ms: float
    queue_depth: int = 0
    batch_size: int = 1  # rows in the target's forward pass that served this call
    batch_tokens: int = 0  # real input tokens in that forward pass


@dataclass(frozen=True)
class ProposeReply:
    token_ids: list[int]
    q: list[SparseQ]
    committed_len: int
    compute_ms: float
    confidence: list[float] = field(default_factory=list)


class TargetClient(Protocol):
    async def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int, timeout: float | None
    ) -> PrefillReply: ...

    async def verify(
        self,
        session_id: str,
        cache_len: int,
        new_ids: Sequence[int],
        draft_ids: Sequence[int],
        q: Sequence[SparseQ],
        timeout: float | None,
    ) -> VerifyReply: ...

    async def release(self, session_id: str, timeout: float | None) -> None: ...


class DraftClient(Protocol):
    async def create(self, cfg: SamplingConfig, drafter: str, timeout: float | None, rng_offset: int = 0) -> str:
        """A draft session; ``rng_offset`` picks a fresh random stream of a
        seeded request for each session it recreates (docs/design.md rule 6)."""

    async def propose(
        self,
        session_id: str,
        base_len: int,
        new_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float,
        timeout: float | None,
    ) -> ProposeReply: ...

    async def release(self, session_id: str, timeout: float | None) -> None: ...


class UnknownDrafter(InvalidArgument):
    """The request named a drafter the draft service does not host."""


class RoundSink(Protocol):
    """Receives every verified round (the metrics path)."""

    def on_round(self, obs: RoundObservation, drafter: str) -> None: ...

    def on_fallback(self) -> None: ...

    def on_rebuild(self) -> None: ...


# --------------------------------------------------------------------- stats
@dataclass
class RequestStats:
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    committed_in_rounds: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prefill_ms: float = 0.0  # the part of verify_ms that prefilled prompts (and rebuilds)
    rtt_ms: float = 0.0  # RPC wall time minus server compute, summed
    draft_failures: int = 0
    target_rebuilds: int = 0
    gamma_trajectory: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Step:
    """Tokens committed by one step (prefill or a verified round)."""

    token_ids: list[int]
    logit_gaps: list[float]


@dataclass
class DecodeParams:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    policy: DraftLengthPolicy
    speculate: bool
    drafter: str = ""  # sent to the draft service ("" = its default)
    drafter_label: str = ""  # the drafter's name for stats and metrics
    draft_timeout_s: float = 5.0
    draft_retry_after_rounds: int = 4
    target_timeout_s: float = 120.0
    release_timeout_s: float = 2.0
    deadline: float | None = None  # time.monotonic() by which the request must end
    min_confidence: float = 0.0  # draft-side confidence early stop; 0 = the policy's (``stop_confidence``)
    context_limited: bool = False  # max_new_tokens was cut to what the model's context holds
    sink: RoundSink | None = None


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
        self.draft_down_until_round = 0
        self._draft_wall_ms = 0.0
        self._tasks: set[asyncio.Future[Any]] = set()  # fire-and-forget releases

    # --------------------------------------------------------------- helpers
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
            self.committed[:-1], self.p.sampling, False, len(self.committed), self._timeout(self.p.target_timeout_s)
        )
        self.target_sid = reply.session_id
        self.target_cache_len = reply.cache_len
        self.stats.verify_ms += reply.compute_ms
        self.stats.prefill_ms += reply.compute_ms

    async def _create_draft(self) -> None:
        assert self.draft is not None
        try:
            self.draft_sid = await self.draft.create(
                self.p.sampling, self.p.drafter, self._timeout(self.p.draft_timeout_s), self.draft_sessions
            )
            self.draft_sessions += 1  # the next session (if this one is lost) gets a fresh stream
            self.draft_known = 0
        except InvalidArgument as e:  # e.g. an unknown drafter name: the client's error
            raise UnknownDrafter(f"speculation.drafter: {e.message}") from None
        except SpecdecError as e:
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
                reply = await self.draft.propose(
                    self.draft_sid,
                    self.draft_known,
                    self.committed[self.draft_known :],
                    gamma,
                    min_confidence,
                    self._timeout(self.p.draft_timeout_s),
                )
                self._draft_wall_ms = (time.perf_counter() - t0) * 1e3
                problem = self._proposal_problem(reply, gamma)
                if problem:
                    self._draft_fault(problem)
                    return None
                self.draft_known = reply.committed_len
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

    def _count_fallback(self) -> None:
        """A round falls back to target-only because of the draft: count it
        and leave the draft alone for ``draft_retry_after_rounds`` rounds."""
        self.stats.draft_failures += 1
        if self.p.sink is not None:
            self.p.sink.on_fallback()
        self.draft_down_until_round = self.stats.rounds + self.p.draft_retry_after_rounds

    # ------------------------------------------------------------------ loop
    async def run(self) -> AsyncIterator[Step]:
        """Yields committed tokens step by step until max_new_tokens. The caller
        stops iterating on EOS or stop strings; ``close()`` releases sessions."""
        # The draft session is created while the target prefills, so an unknown
        # drafter fails the request before any token is streamed.
        draft_task = asyncio.create_task(self._create_draft()) if self.draft is not None else None
        try:
            reply = await self.target.prefill(
                self.p.prompt_ids, self.p.sampling, True, 0, self._timeout(self.p.target_timeout_s)
            )
            self.target_sid, self.target_cache_len = reply.session_id, reply.cache_len
        finally:
            if draft_task is not None:
                await draft_task
        self.stats.verify_ms += reply.compute_ms
        self.stats.prefill_ms += reply.compute_ms
        assert reply.next_token is not None
        self.committed.append(reply.next_token)
        self.stats.first_token_at = time.perf_counter()
        yield Step([reply.next_token], [reply.logit_gap])

        self._continued = False  # the previous round's whole span was accepted
        while self.generated < self.p.max_new_tokens:
            remaining = self.p.max_new_tokens - self.generated
            gamma = min(self.p.policy.next_gamma(), remaining - 1)
            proposal: ProposeReply | None = None
            self._draft_wall_ms = 0.0
            if gamma > 0 and self.draft is not None and self.stats.rounds >= self.draft_down_until_round:
                proposal = await self._propose(gamma, self.p.min_confidence or self.p.policy.stop_confidence())
                if proposal is not None:
                    self.stats.draft_ms += proposal.compute_ms
                    self.stats.rtt_ms += max(0.0, self._draft_wall_ms - proposal.compute_ms)
            draft_ids = proposal.token_ids if proposal else []
            q = proposal.q if (proposal and not self.p.sampling.greedy) else []
            tokens_in_pass = len(self.committed) - self.target_cache_len + len(draft_ids)
            t0 = time.perf_counter()
            verified, draft_ids = await self._verify(draft_ids, q)
            if not draft_ids:
                proposal = None  # the target refused the draft's part: this round ran target-only
            verify_wall_ms = (time.perf_counter() - t0) * 1e3
            self.stats.rtt_ms += max(0.0, verify_wall_ms - verified.compute_ms - verified.queue_ms)
            self.stats.rounds += 1
            self.stats.draft_tokens += len(draft_ids)
            self.stats.accepted_tokens += verified.num_accepted
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
            )
            self._continued = 0 < len(draft_ids) == verified.num_accepted
            self.p.policy.observe(obs)
            if self.p.sink is not None:
                self.p.sink.on_round(obs, self.p.drafter_label)
            new = draft_ids[: verified.num_accepted] + [verified.next_token]
            self.stats.committed_in_rounds += len(new)
            self.committed.extend(new)
            yield Step(new, verified.logit_gaps)

    async def _verify(self, draft_ids: list[int], q: list[SparseQ]) -> tuple[VerifyReply, list[int]]:
        """Verifies the round; returns the reply and the drafted ids it
        verified (empty when the target refused the draft's part).

        NOT_FOUND: the replica lost the session; UNAVAILABLE: the replica is
        gone or draining; FAILED_PRECONDITION: the session is out of step
        with the committed tokens. In each case the session is rebuilt from
        the tokens, on another replica when the client routes over several.
        INVALID_ARGUMENT with a drafted span: the draft's part (q, ids, span)
        was refused, a draft fault (docs/design.md §5): the round is redone
        with γ = 0 and the draft backed off; without a span it is the
        request's own error."""
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
                )
            except InvalidArgument as e:
                if not draft_ids:
                    raise
                self._draft_fault(f"the target refused the drafted span: {e.message}")
                draft_ids, q = [], []
                continue
            except (NotFound, Unavailable, FailedPrecondition) as e:
                if attempt == MAX_REBUILDS_PER_ROUND:
                    raise Unavailable(f"target session lost {attempt + 1} times in one round: {e.message}") from None
                attempt += 1
                await self._rebuild_target(release_old=isinstance(e, FailedPrecondition))
                continue
            self.target_cache_len = reply.cache_len
            self.stats.verify_ms += reply.compute_ms
            return reply, draft_ids

    def _proposal_problem(self, reply: ProposeReply, gamma: int) -> str:
        """What is wrong with a proposal on its face ("" = nothing): a span
        longer than asked for, q not one per drafted token, or tokens drafted
        for another prefix than the committed one (docs/design.md §5)."""
        if len(reply.token_ids) > gamma:
            return f"the draft proposed {len(reply.token_ids)} tokens for a span of {gamma}"
        if reply.q and len(reply.q) != len(reply.token_ids):
            return f"the draft sent {len(reply.q)} distributions for {len(reply.token_ids)} tokens"
        if reply.committed_len != len(self.committed):
            return (f"the draft drafted after {reply.committed_len} committed tokens, "
                    f"not the {len(self.committed)} the request holds")
        return ""

    def _draft_fault(self, error: str) -> None:
        """The draft served something the target refused: count it, drop
        (and release) its session, back its replica off, and run target-only
        rounds for ``draft_retry_after_rounds`` rounds."""
        log(logger, logging.WARNING, "draft fault; round redone target-only", error=error)
        self._count_fallback()
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
        tasks = []
        if self.target_sid is not None:
            tasks.append(self.target.release(self.target_sid, self.p.release_timeout_s))
            self.target_sid = None
        if self.draft is not None and self.draft_sid is not None:
            tasks.append(self.draft.release(self.draft_sid, self.p.release_timeout_s))
            self.draft_sid = None
        if tasks:
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, NotFound):
                    log(logger, logging.WARNING, "session release failed", error=repr(r))
