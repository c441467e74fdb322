"""The draft-chain protocol of a draft stream (docs/architecture.md, "Draft
streams and run-ahead"), both ends in one place, without gRPC: the draft's
``DraftChain`` (what it keeps and drops on each commit, what it drafts
next) and the orchestrator's ``ChainTracker`` (which streamed tokens it may
verify). draft_service/session_stream.py and orchestrator/decode.py drive
them; tests/test_runahead_chain.py checks the two against each other.

A *chain* is the run of tokens drafted after the committed tokens, each on
the committed prefix plus the chain's earlier tokens. It carries a version:
the commit after which it started (the open is version 0). The draft
streams its tokens tagged (version, position), contiguous from the
committed length of that version's commit, and pauses (``ChainPause``)
when it stops drafting before its credit is used.

The rules both ends implement:

- **Kept or dropped.** A commit whose tokens are the chain's own next tokens
  (the target accepted them, and its correction, bonus or post-verified
  token equals the next drafted token) moves them from the chain to the
  committed tokens, and the chain goes on under its version: drafting that
  ran while the target verified is kept (``keeps_chain``). Any other commit
  drops the chain and starts a new one under the commit's version.
- **Resumed.** A commit that holds tokens resumes a paused chain; one
  without tokens (more credit, a new threshold) resumes only a confidence
  or span-cap pause (``commit_resumes``). A pause the draft sent before it
  saw the last commit is stale and ignored.
- **Exactness** (docs/design.md rule 8). The tracker accepts a token only if
  it fits the chain (anything else is a draft fault) and hands out for
  verification only chain tokens whose whole prefix is the committed
  sequence, so a token drafted on a prefix that did not happen is never
  verified, whatever the draft sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from specdec.errors import InvalidArgument
from specdec.sampling import SparseQ
from specdec.validation import check_min_confidence, check_token_ids

#: why a chain paused (DraftPaused.reason)
CONFIDENCE, NO_DRAFT, CONTEXT, LIMIT = "confidence", "no_draft", "context", "limit"


@dataclass(frozen=True)
class ChainToken:
    """One streamed token (DraftedToken)."""

    position: int  # index in the sequence
    version: int  # the chain's version
    token_id: int
    q: SparseQ
    confidence: float
    compute_ms: float
    received: float = 0.0  # time.perf_counter() when the orchestrator got it


@dataclass(frozen=True)
class ChainPause:
    """The chain stopped drafting (DraftPaused)."""

    position: int  # the chain's end: the next position it would draft
    version: int
    reason: str  # CONFIDENCE | NO_DRAFT | CONTEXT | LIMIT
    commit: int = 0  # the last commit the draft had applied when it paused


def keeps_chain(chain: Sequence[int], commit_ids: Sequence[int]) -> bool:
    """A commit keeps the chain when its tokens are the chain's next tokens."""
    return len(chain) >= len(commit_ids) and list(chain[: len(commit_ids)]) == list(commit_ids)


def commit_resumes(pause_reason: str, committed_tokens: int) -> bool:
    """Whether a commit of ``committed_tokens`` tokens resumes a chain paused
    for ``pause_reason``."""
    return committed_tokens > 0 or pause_reason in (CONFIDENCE, LIMIT)


class Drafted(Protocol):
    """What ``DraftChain.add`` reads of a drafting step's result
    (draft_service.drafter.Proposal)."""

    token_ids: list[int]
    q: list[SparseQ]
    confidence: list[float]


# ------------------------------------------------------------ the draft's end
@dataclass(frozen=True)
class Step:
    """One drafting step as the chain asked for it: draft ``num_tokens`` after
    ``context`` (committed + chain). ``epoch`` and ``position`` tell
    ``DraftChain.add`` whether the result still extends the chain."""

    context: list[int]
    num_tokens: int
    epoch: int
    position: int


@dataclass
class DraftChain:
    """``committed``: the committed sequence the caller sent (>= 1 token);
    ``max_span``: the most tokens drafted past it (the service's cap on the
    caller's credit); ``max_context``: the drafter's context limit."""

    committed: list[int]
    max_span: int
    max_context: int
    vocab_size: int
    draft_until: int = 0
    requested_until: int = 0  # the caller's draft_until before the service's cap
    min_confidence: float = 0.0
    version: int = 0  # the chain's version
    commits: int = 0  # the last commit's version
    tokens: list[int] = field(default_factory=list)  # the chain
    epoch: int = 0  # bumped whenever the chain is dropped: a step in flight is then stale
    paused: str = ""
    drafted: int = 0  # tokens drafted in all (kept or not)
    kept: int = 0  # drafted tokens a commit confirmed (the chain went on through them)

    def __post_init__(self) -> None:
        if not self.committed:
            raise InvalidArgument("open.token_ids must hold the committed sequence (at least one token)")
        self._check_ids(self.committed, "open.token_ids")
        self.set_credit(self.draft_until, self.min_confidence)

    @property
    def end(self) -> int:
        """The next position the chain would draft."""
        return len(self.committed) + len(self.tokens)

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        check_token_ids(ids, self.vocab_size, what)

    def set_credit(self, draft_until: int, min_confidence: float) -> None:
        self.min_confidence = check_min_confidence(min_confidence)
        self.requested_until = int(draft_until)
        self.draft_until = min(self.requested_until, len(self.committed) + self.max_span)
        if self.paused == LIMIT:
            self.paused = ""

    def commit(self, version: int, token_ids: Sequence[int], draft_until: int, min_confidence: float) -> None:
        """Applies one DraftCommit. Raises InvalidArgument for a version out
        of order or ids outside the vocabulary (the stream then ends)."""
        ids = [int(t) for t in token_ids]
        if ids:
            if version != self.commits + 1:
                raise InvalidArgument(f"commit version {version} out of order: expected {self.commits + 1}")
            self._check_ids(ids, "commit.token_ids")
            self.commits = version
            n = len(ids)
            if keeps_chain(self.tokens, ids):
                del self.tokens[:n]  # the chain was right: it goes on under its version
                self.kept += n
            else:
                self.tokens.clear()
                self.version = version
                self.epoch += 1
            self.committed.extend(ids)
        if self.paused and commit_resumes(self.paused, len(ids)):
            self.paused = ""  # tokens, or more credit / a new threshold after a confidence stop: try again
        self.set_credit(draft_until, min_confidence)

    def want(self) -> int:
        """Tokens the chain may draft now (0 = none: paused, out of credit or of context)."""
        if self.paused:
            return 0
        room = min(self.draft_until, self.max_context) - self.end
        return max(0, room)

    def blocked(self) -> ChainPause | None:
        """When the chain cannot draft what the caller asked for (its context
        is full, or the service's span cap is below the caller's credit):
        pauses it and returns the event to send, once."""
        if self.paused:
            return None
        if self.end >= self.max_context:
            self.paused = CONTEXT
        elif self.draft_until < self.requested_until and self.end >= self.draft_until:
            self.paused = LIMIT
        else:
            return None
        return ChainPause(self.end, self.version, self.paused, self.commits)

    def next_step(self, inline: bool) -> Step | None:
        """The next drafting step: one token for a model drafter (so each is
        streamed as soon as it exists and a commit can cut the run short),
        every token the credit allows for an inline (model-free) drafter."""
        n = self.want()
        if n <= 0:
            return None
        return Step(self.committed + self.tokens, n if inline else 1, self.epoch, self.end)

    def add(self, step: Step, proposal: Drafted, compute_ms: float) -> list[ChainToken | ChainPause]:
        """Extends the chain with a step's result and returns the events to
        send. A stale result (the chain was dropped, or moved, while the step
        ran) is discarded: it was drafted on a prefix that is no longer the
        chain's."""
        if step.epoch != self.epoch or step.position != self.end:
            return []
        events: list[ChainToken | ChainPause] = []
        if not proposal.token_ids:
            self.paused = CONTEXT if self.end >= self.max_context else NO_DRAFT
            return [ChainPause(self.end, self.version, self.paused, self.commits)]
        per_token = compute_ms / len(proposal.token_ids)
        for i, x in enumerate(proposal.token_ids):
            if self.end >= self.draft_until:
                break  # the credit shrank while the step ran
            conf = proposal.confidence[i] if i < len(proposal.confidence) else 1.0
            position = self.end
            self.tokens.append(int(x))
            self.drafted += 1
            events.append(ChainToken(position, self.version, int(x), proposal.q[i], conf, per_token))
            if position > len(self.committed) and conf < self.min_confidence:
                # a likely rejection: drafting past it is probably wasted
                self.paused = CONFIDENCE
                events.append(ChainPause(self.end, self.version, self.paused, self.commits))
                break
        return events


# ----------------------------------------------------- the orchestrator's end
class StreamFault(Exception):
    """The draft stream sent something no honest draft sends."""


@dataclass(frozen=True)
class Span:
    tokens: list[ChainToken]  # the drafted span to verify (positions L, L+1, ...)
    post: ChainToken | None  # the token right after it, when it already arrived (post-verify)
    complete: bool  # False: more tokens may still come for this span


@dataclass
class ChainTracker:
    """``lengths[v]``: the committed length after commit v (0 = the open)."""

    lengths: dict[int, int] = field(default_factory=dict)
    version: int = -1
    start: int = 0
    chain: list[ChainToken] = field(default_factory=list)
    paused_at: int = -1  # the position the chain last paused at (the chain's end then)
    pause_reason: str = ""
    commits: int = 0  # the last commit version sent
    received: int = 0
    stale: int = 0  # tokens of a superseded version (in flight when the chain restarted)

    def sent(self, version: int, committed_len: int) -> None:
        """Records a commit (or the open, version 0) the orchestrator sent.
        A commit that resumes the draft (``commit_resumes``) voids the
        pause: the chain's end is
        no longer where the draft stopped, even when the commit kept the
        chain (the post-verified token at a confidence stop was accepted)."""
        new_tokens = committed_len - self.lengths.get(self.commits, committed_len)
        if self.paused_at >= 0 and commit_resumes(self.pause_reason, new_tokens):
            self.paused_at, self.pause_reason = -1, ""
        self.lengths[version] = committed_len
        self.commits = version
        if self.version < 0:
            self.version, self.start = version, committed_len

    def _restart(self, version: int, position: int) -> None:
        if version not in self.lengths:
            raise StreamFault(f"the draft sent version {version}, which was never committed")
        if position != self.lengths[version]:
            raise StreamFault(
                f"the draft started version {version} at position {position}, not at its committed length "
                f"{self.lengths[version]}"
            )
        self.version, self.start, self.chain, self.paused_at = version, position, [], -1

    def on_token(self, tok: ChainToken) -> None:
        self.received += 1
        if tok.version < self.version:
            self.stale += 1
            return
        if tok.version > self.version:
            self._restart(tok.version, tok.position)
        if tok.position != self.start + len(self.chain):
            raise StreamFault(
                f"the draft sent position {tok.position} for version {tok.version}; the chain is at "
                f"{self.start + len(self.chain)}"
            )
        self.chain.append(tok)  # after a pause too: a commit resumes the chain

    def on_pause(self, ev: ChainPause) -> None:
        if ev.version < self.version or ev.commit < self.commits:
            return  # superseded: a later commit resumes the chain
        if ev.version > self.version:
            self._restart(ev.version, ev.position)
        if ev.position != self.start + len(self.chain):
            raise StreamFault(f"the draft paused version {ev.version} at {ev.position}, not at its chain's end")
        self.paused_at, self.pause_reason = ev.position, ev.reason

    @property
    def end(self) -> int:
        return self.start + len(self.chain)

    def usable(self, committed: Sequence[int]) -> list[ChainToken] | None:
        """Chain tokens at positions ≥ len(committed) whose prefix is exactly
        ``committed``. None: the chain does not (yet) cover the committed end,
        or it disagrees with it (a new version will come)."""
        end = len(committed)
        k = end - self.start
        if k < 0 or len(self.chain) < k:
            return None
        for i in range(k):
            if self.chain[i].token_id != committed[self.start + i]:
                return None
        return self.chain[k:]

    def span(self, committed: Sequence[int], gamma: int, min_confidence: float) -> Span:
        """The next span of at most ``gamma`` tokens after ``committed``. It
        ends before a token (not the first) whose draft confidence is below
        ``min_confidence``; that token, or the one after a span of ``gamma``,
        is the post-verify candidate when it has arrived. ``complete`` when
        the span can grow no more: γ reached, a confidence stop, or the
        chain paused at its end."""
        tokens = self.usable(committed)
        if tokens is None:
            return Span([], None, False)
        n = min(gamma, len(tokens))
        cut = False
        for i in range(1, n):
            if tokens[i].confidence < min_confidence:
                n, cut = i, True
                break
        if not cut and n < len(tokens) and n >= 1 and tokens[n].confidence < min_confidence:
            cut = True  # the next token is a confidence stop
        span = tokens[:n]
        post = tokens[n] if n < len(tokens) else None
        complete = n >= gamma or cut or self.paused_at == self.end
        return Span(span, post, complete)
