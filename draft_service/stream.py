"""One draft stream's state: the committed tokens, the chain drafted past
them, its version, and the caller's credit. Domain logic only (no gRPC, no
threads): the servicer feeds it commits and drafting results and sends the
events it returns (docs/architecture.md, "Draft streams and run-ahead").

A *chain* is the run of tokens drafted after the committed tokens, each on
the committed prefix plus the chain's earlier tokens. It carries a version:
the commit after which it started (the open is version 0). A commit whose
tokens are the chain's own next tokens (the target accepted them, and its
correction or bonus equals the next drafted token) moves them from the chain
to the committed tokens and the chain goes on under its version: drafting
that ran while the target verified is kept. Any other commit drops the chain
and starts a new one under the commit's version. The caller validates every
token it receives against the same rule (``orchestrator/runahead.py``), so a
token drafted on a prefix that did not happen is never verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from draft_service.drafter import Proposal
from specdec.errors import InvalidArgument
from specdec.sampling import SparseQ
from specdec.validation import check_min_confidence, check_token_ids


@dataclass(frozen=True)
class StreamedToken:
    position: int  # index in the sequence
    version: int  # the chain's version
    token_id: int
    q: SparseQ
    confidence: float
    compute_ms: float


@dataclass(frozen=True)
class ChainPaused:
    position: int  # the chain's end: the next position it would draft
    version: int
    reason: str  # confidence | no_draft | context | limit
    commit: int = 0  # the last commit applied when it paused


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
        if self.paused == "limit":
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
            if self.tokens[:n] == ids and len(self.tokens) >= n:
                del self.tokens[:n]  # the chain was right: it goes on under its version
                self.kept += n
            else:
                self.tokens.clear()
                self.version = version
                self.epoch += 1
            self.committed.extend(ids)
            self.paused = ""
        elif self.paused == "confidence":
            self.paused = ""  # more credit or a new threshold: let it try again
        self.set_credit(draft_until, min_confidence)

    def want(self) -> int:
        """Tokens the chain may draft now (0 = none: paused, out of credit or of context)."""
        if self.paused:
            return 0
        room = min(self.draft_until, self.max_context) - self.end
        return max(0, room)

    def blocked(self) -> ChainPaused | None:
        """When the chain cannot draft what the caller asked for (its context
        is full, or the service's span cap is below the caller's credit):
        pauses it and returns the event to send, once."""
        if self.paused:
            return None
        if self.end >= self.max_context:
            self.paused = "context"
        elif self.draft_until < self.requested_until and self.end >= self.draft_until:
            self.paused = "limit"
        else:
            return None
        return ChainPaused(self.end, self.version, self.paused, self.commits)

    def next_step(self, inline: bool) -> Step | None:
        """The next drafting step: one token for a model drafter (so each is
        streamed as soon as it exists and a commit can cut the run short),
        every token the credit allows for an inline (model-free) drafter."""
        n = self.want()
        if n <= 0:
            return None
        return Step(self.committed + self.tokens, n if inline else 1, self.epoch, self.end)

    def add(self, step: Step, proposal: Proposal, compute_ms: float) -> list[StreamedToken | ChainPaused]:
        """Extends the chain with a step's result and returns the events to
        send. A stale result (the chain was dropped, or moved, while the step
        ran) is discarded: it was drafted on a prefix that is no longer the
        chain's."""
        if step.epoch != self.epoch or step.position != self.end:
            return []
        events: list[StreamedToken | ChainPaused] = []
        if not proposal.token_ids:
            self.paused = "context" if self.end >= self.max_context else "no_draft"
            return [ChainPaused(self.end, self.version, self.paused, self.commits)]
        per_token = compute_ms / len(proposal.token_ids)
        for i, x in enumerate(proposal.token_ids):
            if self.end >= self.draft_until:
                break  # the credit shrank while the step ran
            conf = proposal.confidence[i] if i < len(proposal.confidence) else 1.0
            position = self.end
            self.tokens.append(int(x))
            self.drafted += 1
            events.append(StreamedToken(position, self.version, int(x), proposal.q[i], conf, per_token))
            if position > len(self.committed) and conf < self.min_confidence:
                # a likely rejection: drafting past it is probably wasted
                self.paused = "confidence"
                events.append(ChainPaused(self.end, self.version, self.paused, self.commits))
                break
        return events
