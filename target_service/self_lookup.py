"""Prompt lookup inside decode-ahead: the target drafts for itself.

A decode-ahead run (VerifyRequest.decode_ahead) answers plain steps the
orchestrator would otherwise ask for one round trip at a time. With
``ahead_lookup_tokens`` set, a step of the run may instead verify the
continuation of the longest earlier match of the session's last tokens
(``specdec.ngram.TrustedLookup``: 2-4 tokens matched, trusted while its
candidates' first tokens keep coming true), as a drafted span with one-hot
q: the verifier's exact rule (docs/design.md rule 3), so the output keeps
the target's distribution. Whether a step drafts, and what, depends only on
the committed tokens (rule 5).

Why here and not only in the orchestrator (orchestrator/lookup.py): there
every lookup round is a round trip, and while lookup may propose the target
cannot decode ahead, so on text where lookup rarely matches the request ran
5-10 % behind plain decoding (docs/benchmarks.md, 2026-12-04). Inside the
run both costs are gone: a miss is a plain step, a hit a multi-token step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdec.ngram import TrustedLookup
from target_service.calls import VerifyCall


def self_draft(call: VerifyCall, sess: Any, max_span: int, max_context: int) -> VerifyCall:
    """``call`` (a plain verify with ``lookup_tokens`` > 0) as the call that
    verifies ``sess``'s trusted lookup span, or unchanged when there is none.
    ``sess.lookup`` keeps the session's index and trust between steps."""
    if sess.lookup is None:
        sess.lookup = TrustedLookup()
    room = min(call.lookup_tokens, max_span, max_context - 1 - sess.cache_len - len(call.new_ids))
    span = sess.lookup.candidate(sess.tokens[: sess.cache_len] + list(call.new_ids), max(0, room))
    if not span:
        return call
    return dataclasses.replace(call, draft_ids=span, draft_q=[None] * len(span), self_drafted=True)
