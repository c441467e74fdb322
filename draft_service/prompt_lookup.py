"""Prompt-lookup (n-gram) drafting: no model.

The last n committed tokens (n adaptive: ``max_ngram`` down to ``min_ngram``,
longest first) are looked up among earlier positions of the committed
sequence (prompt + generated text); at the most recent earlier occurrence,
the tokens that followed it are proposed (up to γ). Each proposed token has a
one-hot q (``ids=[x], probs=[1.0]``), which the target's verifier treats as
docs/design.md rule 3: accept with probability p(x), otherwise sample from p with
x removed. Confidence of a hit is 1.0. No match: no tokens (the round is a
plain target step).

Cost: an incremental index ``n-gram -> end position of its most recent
occurrence that has a continuation``; a call adds the new committed tokens
(O(new tokens × n)) and does at most ``max_ngram - min_ngram + 1`` dict
look-ups. A committed sequence that diverges from the indexed one (a rebuilt
session) re-indexes from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from draft_service.drafter import Drafter, DraftRequest, Proposal
from specdec.ngram import NgramIndex
from specdec.sampling import one_hot_q


@dataclass
class PromptLookupState:
    index: NgramIndex
    hits: int = 0
    misses: int = 0
    last_ngram: int = 0


class PromptLookupDrafter(Drafter):
    """Model-free drafter over the target vocabulary (``vocab_size`` ids)."""

    inline = True  # microseconds per call: served on the event loop

    def __init__(
        self,
        name: str,
        vocab_size: int,
        *,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_context_tokens: int = 1 << 20,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.name = name
        self.vocab_size = vocab_size
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_context_tokens = max_context_tokens

    def new_state(self) -> PromptLookupState:
        return PromptLookupState(NgramIndex(self.min_ngram, self.max_ngram))

    def draft(self, state: PromptLookupState, req: DraftRequest) -> Proposal:
        """Up to ``req.num_tokens`` ids continuing the most recent earlier
        occurrence of the committed suffix; one-hot q each. ``req.cfg``,
        ``req.rng`` and ``req.min_confidence`` do not change a one-hot proposal."""
        state.index.sync(req.committed)
        n, ids = state.index.lookup(req.num_tokens)
        state.last_ngram = n
        ids = constrained(ids, req)
        if not ids:
            state.misses += 1
            return Proposal([], [])
        state.hits += 1
        q = one_hot_q(ids)
        return Proposal(list(ids), q, 0, [1.0] * len(ids))


def constrained(ids: list[int], req: DraftRequest) -> list[int]:
    """The proposal up to the first token the request's grammar forbids (a
    one-hot q on such a token could only be rejected)."""
    if req.constraint is None or not ids:
        return ids
    return list(ids[: req.constraint.allowed_prefix(ids)])


@dataclass
class AutoState:
    lookup: PromptLookupState
    model: Any
    score: float = 1.0  # EMA of prompt-lookup first-token hits
    pending: tuple[int, int] | None = None  # (position, token) prompt lookup predicted last round
    used_lookup: int = 0
    used_model: int = 0


class AutoDrafter(Drafter):
    """Prompt lookup when it is matching well, otherwise a model drafter.

    Each round, prompt lookup's candidate (when there is one) is scored
    against what the target then commits at that position — whether or not
    it was proposed — as an exponential moving average of first-token hits.
    The round uses prompt lookup when the match is at least ``min_ngram``
    tokens long and the score is at least ``threshold``; otherwise the model
    drafter. The choice uses only information from before the round's
    verification, and each round's q is the q its drafter sampled, so the
    output distribution is unchanged (docs/design.md rules 2, 3, 5).
    """

    inline = False  # the model drafter runs on the worker thread

    def __init__(
        self,
        name: str,
        lookup: PromptLookupDrafter,
        model: Drafter,
        *,
        min_ngram: int = 2,
        threshold: float = 0.5,
        decay: float = 0.7,
    ) -> None:
        if lookup.vocab_size != model.vocab_size:
            raise ValueError("prompt lookup and the model drafter must share the target vocabulary")
        self.name = name
        self.lookup = lookup
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_context_tokens = model.max_context_tokens
        self.min_ngram = min_ngram
        self.threshold = threshold
        self.decay = decay
        self.kv_model = model.kv_model

    def kv_state(self, state: AutoState) -> Any:
        return self.model.kv_state(state.model)

    def new_state(self) -> AutoState:
        return AutoState(self.lookup.new_state(), self.model.new_state())

    def draft(self, state: AutoState, req: DraftRequest) -> Proposal:
        """Prompt lookup's proposal when it is trusted this round, otherwise
        the model drafter's."""
        committed = req.committed
        if state.pending is not None:
            pos, tok = state.pending
            if pos < len(committed):
                hit = 1.0 if committed[pos] == tok else 0.0
                state.score = self.decay * state.score + (1 - self.decay) * hit
            state.pending = None
        state.lookup.index.sync(committed)
        n, ids = state.lookup.index.lookup(req.num_tokens)
        ids = constrained(ids, req)
        if ids:
            state.pending = (len(committed), ids[0])
        if ids and n >= self.min_ngram and state.score >= self.threshold:
            state.used_lookup += 1
            q = one_hot_q(ids)
            return Proposal(list(ids), q, 0, [1.0] * len(ids))
        state.used_model += 1
        return self.model.draft(state.model, req)

    def pending(self, state: AutoState, committed: Sequence[int]) -> int:
        return self.model.pending(state.model, committed)

    def catch_up(self, state: AutoState, committed: Sequence[int], max_tokens: int) -> tuple[int, int, int]:
        return self.model.catch_up(state.model, committed, max_tokens)
