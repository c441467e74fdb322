"""Prompt lookup in the orchestrator: n-gram drafting from the committed
tokens it already holds, with no call to the draft service.

The ``auto`` drafter is prompt lookup while it matches well, else the model
drafter. Run on the draft service, every round of it costs a Propose round
trip, and the orchestrator's policy prices the round at the model drafter's
cost, because it cannot know beforehand which of the two will serve it.
Against a quantized CPU target whose step costs about two model-draft tokens
(docs/benchmarks.md), that price says speculation never pays, so ``auto``
drafted almost nothing even where the prompt is copied token for token.

Here the orchestrator looks up the suffix of its own token sequence first
(``specdec.ngram.NgramIndex``, microseconds a round). When the match is long
enough and trusted, the round verifies that continuation: q is one-hot, the
verifier's docs/design.md rule 3, exactly as the draft service's
prompt-lookup drafter would send it. Its span length comes from its own
policy, whose costs are the target's verify curve alone (a local lookup
costs no drafting). Otherwise the round is the model drafter's, chosen and
priced by the request's usual policy. Which path a round takes depends only
on the committed tokens, known before its verification, so the output's
distribution is the target's (rules 3 and 5).

Trust: the candidate's first token, proposed or not, is scored against the
token the target then commits at that position (an exponential moving
average of hits, as ``AutoDrafter`` scores it), every round, also the rounds
that do not draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from orchestrator.policy import DraftLengthPolicy
from specdec.ngram import TrustedLookup

#: the drafter name whose requests get prompt lookup in the orchestrator
LOOKUP_DRAFTER = "auto"


@dataclass
class LocalLookup(TrustedLookup):
    """One request's prompt-lookup state over its committed tokens (the
    candidate and its trust: ``specdec.ngram.TrustedLookup``)."""

    idle: int = 0  # rounds in a row that verified no lookup span
    #: rounds in a row without a lookup span after which lookup counts as
    #: dormant: plain rounds may then run ahead on the target, this many at
    #: a time (decode-ahead hides each round's round trip)
    dormant_after: int = 8
    #: plain rounds the target was asked to decode ahead (a promise: a span
    #: in one of them would stop the run in mid-step and put the target's
    #: session out of step with the committed tokens, a rebuild)
    promised_rounds: int = 0
    #: the target verifies lookup spans inside its decode-ahead runs
    #: (target_service/self_lookup.py), so plain rounds always run ahead
    on_target: bool = True

    @property
    def dormant(self) -> bool:
        return self.idle >= self.dormant_after

    def ahead_room(self, room: int) -> int:
        """How many plain rounds the target may decode ahead. With lookup on
        the target (``on_target``) all of them: the run's steps verify the
        spans this lookup would have proposed, with no round trip each.
        Otherwise none while lookup may propose, at most ``dormant_after``
        at a time while it is dormant (so it is asked again that often)."""
        if self.on_target:
            return room
        return min(room, self.dormant_after) if self.dormant else 0

    def grant(self, n: int, room: int, policy: object, lookup_policy: DraftLengthPolicy | None,
              max_tokens: int) -> tuple[int, int]:
        """(rounds, span cap) of a decode-ahead run after a plain round that
        the request's policy committed ``n`` plain rounds to. On the target,
        a run whose steps verified spans ends after fewer rounds than
        committed: the rounds still committed (``policy.plain_rounds_left``)
        run ahead again, and the run's spans are at most what the lookup
        policy would verify now (0: it would not, the run is plain)."""
        if self.on_target and n == 0:
            n = min(room, int(getattr(policy, "plain_rounds_left", 0)))
        cap = min(max_tokens, lookup_policy.next_gamma()) if (self.on_target and n > 0 and lookup_policy) else 0
        return self.promised(n), cap

    def promised(self, rounds: int) -> int:
        """A new grant: the next ``rounds`` rounds are plain (decoded ahead).
        0 (a plain round inside a grant, asking for nothing more) leaves the
        rounds still promised as they are."""
        if rounds > 0:
            self.promised_rounds = rounds
        return rounds

    def note_round(self, verified_span: bool) -> None:
        """Whether the round just chosen verifies a lookup span."""
        self.idle = 0 if verified_span else self.idle + 1

    def next_span(self, committed: Sequence[int], max_tokens: int, policy: DraftLengthPolicy) -> list[int]:
        """The span the next round verifies ([] = none): the trusted
        candidate, as long as ``policy`` chooses."""
        ids = self.candidate(committed, max_tokens)  # scored and indexed every round
        if self.promised_rounds > 0:
            self.promised_rounds -= 1
            ids = []
        span = ids[: min(policy.next_gamma(), len(ids))] if ids else []
        self.note_round(bool(span))
        return span
