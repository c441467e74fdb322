"""An incremental n-gram index over a token sequence: the shared core of
prompt-lookup drafting, on the draft service (draft_service/prompt_lookup.py)
and in the orchestrator (orchestrator/lookup.py). Plain Python, no models.

``lookup`` finds the longest suffix of the sequence (``max_n`` tokens down to
``min_n``) that occurred earlier, and returns what followed its most recent
earlier occurrence. ``sync`` indexes only the tokens added since the last
call, so a round costs O(new tokens × n) plus a few dict look-ups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class NgramIndex:
    """``index[n - min_n][gram]`` = end e (exclusive) of the most recent
    occurrence ``tokens[e-n:e] == gram`` with ``e < len(tokens)``, so the
    continuation ``tokens[e]`` exists. The current suffix is never indexed
    until a token follows it."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    index: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.index = [{} for _ in range(self.max_n - self.min_n + 1)]

    def sync(self, committed: Sequence[int]) -> None:
        """Makes the index describe ``committed`` (appends incrementally; a
        divergent prefix re-indexes everything)."""
        k = len(self.tokens)
        if k > len(committed) or list(committed[:k]) != self.tokens:
            self.tokens = []
            self.index = [{} for _ in range(self.max_n - self.min_n + 1)]
            k = 0
        toks = self.tokens
        for t in committed[k:]:
            j = len(toks)  # position of the new token: every gram ending at j gains a continuation
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.index[n - self.min_n][tuple(toks[j - n : j])] = j
            toks.append(int(t))

    def lookup(self, max_tokens: int) -> tuple[int, list[int]]:
        """(n, continuation) for the longest matching suffix; (0, []) if none."""
        toks = self.tokens
        size = len(toks)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            e = self.index[n - self.min_n].get(tuple(toks[size - n :]))
            if e is not None:
                return n, toks[e : min(e + max_tokens, size)]
        return 0, []


@dataclass
class TrustedLookup:
    """Prompt lookup over a growing token sequence with a trust score: the
    candidate continuation's first token, proposed or not, is scored against
    the token later committed at that position (an exponential moving
    average of hits), and a match is proposed only while the score is at the
    threshold and the matched suffix is at least ``min_ngram`` long. The
    orchestrator's per-request lookup (orchestrator/lookup.py) and the
    target's lookup inside decode-ahead (target_service/server.py) are this."""

    min_ngram: int = 2  # the shortest matched suffix that is trusted to draft
    max_ngram: int = 4
    threshold: float = 0.5  # trusted while the hit score is at least this
    decay: float = 0.7
    score: float = 1.0
    index: NgramIndex = field(init=False)
    _pending: tuple[int, int] | None = None  # (position, token) the last candidate predicted
    hits: int = 0  # scored candidates whose first token the target committed
    scored: int = 0

    def __post_init__(self) -> None:
        self.index = NgramIndex(1, self.max_ngram)

    @property
    def trusted(self) -> bool:
        """Whether a match would be proposed now (the hit score is at the threshold)."""
        return self.score >= self.threshold

    def candidate(self, committed: Sequence[int], max_tokens: int) -> list[int]:
        """The continuation to verify next (at most ``max_tokens``), or []
        when there is no trusted match. Scores the previous candidate against
        what was committed since."""
        if self._pending is not None:
            pos, tok = self._pending
            if pos < len(committed):
                hit = committed[pos] == tok
                self.score = self.decay * self.score + (1.0 - self.decay) * float(hit)
                self.hits += int(hit)
                self.scored += 1
                self._pending = None
        self.index.sync(committed)
        n, ids = self.index.lookup(max_tokens) if max_tokens > 0 else (0, [])
        if ids:
            self._pending = (len(committed), int(ids[0]))
        if not ids or n < self.min_ngram or not self.trusted:
            return []
        return [int(x) for x in ids]
