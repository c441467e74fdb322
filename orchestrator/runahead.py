"""The orchestrator's view of a draft stream's chain (docs/architecture.md,
"Draft streams and run-ahead"). Pure logic, no gRPC.

The draft streams tokens tagged (version, position). Tokens of one version
form one chain, contiguous from the committed length of that version's
commit; each was drafted on that committed prefix plus the chain's earlier
tokens. ``ChainTracker`` accepts a token only if it fits that rule (anything
else is a draft fault), and hands out for verification only chain tokens
whose whole prefix is the committed sequence: the chain's tokens before the
committed end must be exactly the committed tokens there. So a token drafted
on a prefix that did not happen is never verified, whatever the draft sends
(docs/design.md rule 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdec.sampling import SparseQ


@dataclass(frozen=True)
class StreamToken:
    position: int
    version: int
    token_id: int
    q: SparseQ
    confidence: float
    compute_ms: float
    received: float = 0.0  # time.perf_counter() when it arrived


@dataclass(frozen=True)
class StreamPause:
    position: int
    version: int
    reason: str
    commit: int = 0  # the last commit the draft had applied


class StreamFault(Exception):
    """The draft stream sent something no honest draft sends."""


@dataclass(frozen=True)
class Span:
    tokens: list[StreamToken]  # the drafted span to verify (positions L, L+1, ...)
    post: StreamToken | None  # the token right after it, when it already arrived (post-verify)
    complete: bool  # False: more tokens may still come for this span


@dataclass
class ChainTracker:
    """``lengths[v]``: the committed length after commit v (0 = the open)."""

    lengths: dict[int, int] = field(default_factory=dict)
    version: int = -1
    start: int = 0
    chain: list[StreamToken] = field(default_factory=list)
    paused_at: int = -1  # the position the chain last paused at (the chain's end then)
    pause_reason: str = ""
    commits: int = 0  # the last commit version sent
    received: int = 0
    stale: int = 0  # tokens of a superseded version (in flight when the chain restarted)

    def sent(self, version: int, committed_len: int) -> None:
        """Records a commit (or the open, version 0) the orchestrator sent.
        A commit that resumes the draft (it holds tokens, or the pause was a
        confidence stop or the span cap) voids the pause: the chain's end is
        no longer where the draft stopped, even when the commit kept the
        chain (the post-verified token at a confidence stop was accepted)."""
        grew = committed_len > self.lengths.get(self.commits, committed_len)
        if self.paused_at >= 0 and (grew or self.pause_reason in ("confidence", "limit")):
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

    def on_token(self, tok: StreamToken) -> None:
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

    def on_pause(self, ev: StreamPause) -> None:
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

    def usable(self, committed: Sequence[int]) -> list[StreamToken] | None:
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
