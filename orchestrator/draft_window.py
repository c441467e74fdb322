"""The draft model's context window: what a unary Propose sends the draft.

The draft only proposes; the target verifies every token against its own
distribution, so what the draft conditions on changes acceptance and cost,
never the output (docs/design.md rules 3 and 5). A catch-up, the committed
tokens the draft has not taken in yet (the prompt at a request's first
drafted round, everything since the last drafted round after plain ones),
costs the draft a prefill of that many tokens before it can draft. On CPU,
where draft and target share the cores, that prefill is paid in the
request's time: 741 prompt tokens cost the 0.5B draft 1.4 s on one 2-core
machine (about 5 s on a slow AVX2 one), far more than a first probe of the
drafter may cost a request (orchestrator/probing.py), so AUTO never tried
the drafter on a long prompt.

With a window of W tokens, a catch-up of more than W tokens instead keeps
the first ``sink`` tokens the draft holds and takes in only the last W
committed ones: the draft's sequence is then the committed tokens with a
range in the middle left out, [sink, sink + skip). The sink keeps the
start of the sequence (the chat template's opening) that attention leans
on, as StreamingLLM's attention sinks do; drafting from a sink plus a
recent window is how MagicDec and TriForce keep a draft's cost bounded on
long contexts. Positions in the draft's sequence are contiguous; the draft
service needs nothing new (a Propose names the prefix of its sequence to
keep and the tokens to append, and it reuses what it holds).

Pure functions, no I/O: the loop (orchestrator/decode.py) keeps ``skip``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class DraftFeed:
    """One Propose's context: keep the first ``base`` tokens of the draft's
    sequence and append ``tokens``; afterwards the draft's sequence leaves
    out the committed tokens [sink, sink + skip)."""

    base: int
    tokens: list[int]
    skip: int

    def draft_len(self) -> int:
        """The length of the draft's sequence once it has taken ``tokens`` in."""
        return self.base + len(self.tokens)


def plan_feed(committed: Sequence[int], known: int, skip: int, window: int, sink: int) -> DraftFeed:
    """The next Propose's context for a draft that holds the committed tokens
    up to ``known`` (committed positions) less [sink, sink + skip).

    ``window`` <= 0 turns windowing off: the draft takes in every committed
    token after ``known``. Otherwise a catch-up of more than ``window``
    tokens keeps at most ``sink`` tokens of what the draft holds and
    appends the last ``window`` committed tokens."""
    n = len(committed)
    held = known - skip  # the draft's sequence length
    sink = max(0, sink)
    if window <= 0 or n - known <= window or n <= sink + window:
        return DraftFeed(held, list(committed[known:]), skip)
    base = min(sink, held)  # the draft's first tokens are committed[:base] (the window never cuts the sink)
    return DraftFeed(base, list(committed[base:sink]) + list(committed[n - window:]), n - window - sink)
