"""Validation of a prompt's size, of a Verify's sparse draft distributions
(docs/design.md rule 2) and of its post-verify token: plain functions, no
model."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.sampling import SparseQ
from specdec.validation import check_token_id, check_token_ids


def check_prompt_fits(tokens: int, max_context: int, kv_budget_tokens: int) -> None:
    """INVALID_ARGUMENT for a prompt the context cannot hold (it never
    could), RESOURCE_EXHAUSTED for one the whole KV budget cannot hold (a
    replica with a larger budget could): both before any work is queued."""
    if tokens >= max_context:
        raise InvalidArgument(f"prompt of {tokens} tokens does not fit the context of {max_context} tokens")
    if tokens > kv_budget_tokens:
        raise ResourceExhausted(f"prompt of {tokens} tokens exceeds this replica's KV budget of {kv_budget_tokens} tokens")


def check_draft_q(draft_ids: Sequence[int], draft_q: Sequence[SparseQ | None], vocab_size: int, max_support: int) -> None:
    if len(draft_q) != len(draft_ids):
        raise InvalidArgument(
            f"draft_probs has {len(draft_q)} entries for {len(draft_ids)} drafted tokens (must match, or be empty for one-hot q)"
        )
    for i, (x, q) in enumerate(zip(draft_ids, draft_q)):
        if q is not None:
            check_q(x, q, f"draft_probs[{i}]", "drafted token", vocab_size, max_support)


def check_q(x: int, q: SparseQ, name: str, role: str, vocab_size: int, max_support: int) -> None:
    """One sparse q and the token ``x`` sampled from it; ``name`` is the
    request field in messages, ``role`` names x."""
    ids, probs = q
    if ids.shape[0] == 0 or ids.shape != probs.shape:
        raise InvalidArgument(
            f"{name}: token_ids ({ids.shape[0]}) and probs ({probs.shape[0]}) must be non-empty and of equal length"
        )
    if ids.shape[0] > max_support:
        raise InvalidArgument(f"{name}: support of {ids.shape[0]} exceeds the limit {max_support}")
    check_token_ids(ids, vocab_size, f"{name}.token_ids")
    if np.unique(ids).shape[0] != ids.shape[0]:
        raise InvalidArgument(f"{name}: duplicate token ids")
    if not np.all(np.isfinite(probs)) or probs.min() < 0:
        raise InvalidArgument(f"{name}: probabilities must be finite and >= 0")
    total = float(probs.astype(np.float64).sum())
    if not math.isclose(total, 1.0, abs_tol=1e-3):
        raise InvalidArgument(f"{name}: probabilities sum to {total:.6f}, not 1")
    hit = np.nonzero(ids == x)[0]
    if hit.size == 0 or probs[hit[0]] <= 0:
        raise InvalidArgument(f"{name}: {role} {x} has zero probability under its own q")


def check_post(post_id: int, post_q: SparseQ | None, greedy: bool, vocab_size: int, max_support: int) -> None:
    """The post-verify token: in the vocabulary; on a sampled session its q
    passes the draft q checks (a greedy session ignores q)."""
    check_token_id(post_id, vocab_size, "post_token_id")
    if not greedy and post_q is not None:
        check_q(post_id, post_q, "post_prob", "post token", vocab_size, max_support)
