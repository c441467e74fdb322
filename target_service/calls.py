"""The target engine's units of work and their results: a Prefill or Verify
call as the batch scheduler (target_service/batching.py) queues it, what the
engine returns for it, and the forward pass that served it. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from specdec.grammar import GrammarState
from specdec.sampling import SamplingConfig, SparseQ, TokenLogprob, VerifyResult


@dataclass(frozen=True)
class PrefillOutcome:
    session_id: str
    next_token: int | None
    logit_gap: float
    cache_len: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the next token's, when the session asked
    dead_end: bool = False  # the grammar allows no first token (next_token is None)


@dataclass(frozen=True)
class VerifyOutcome:
    result: VerifyResult
    cache_len: int
    logit_gaps: list[float]  # one per committed token (accepted + next)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the same tokens', when the session asked
    # the grammar allows no token after the accepted ones: result.next_token is not emitted
    dead_end: bool = False


@dataclass(frozen=True)
class PrefillCall:
    """One Prefill request as the batch scheduler queues it."""

    token_ids: list[int]
    cfg: SamplingConfig
    sample_next: bool
    rng_offset: int = 0
    top_logprobs: int = -1  # the session reports logprobs with this many top tokens; -1 = none
    grammar: GrammarState | None = None  # structured output: the new session's grammar state (a fresh copy)
    # the id the caller chose for the new session ("" = the engine picks one);
    # not ``session_id``, which the batch scheduler reads as an existing session's
    requested_id: str = ""

    session_id = ""  # a new session: never collides with another call in a batch

    @property
    def past_len(self) -> int:
        return 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class VerifyCall:
    """One Verify request as the batch scheduler queues it."""

    session_id: str
    cache_len: int
    new_ids: list[int]
    draft_ids: list[int]
    draft_q: list[SparseQ | None]
    # post-verify: a token drafted at the bonus position on the span's prefix,
    # and its q (None = one-hot); never fed into the cache
    post_id: int | None = None
    post_q: SparseQ | None = None

    @property
    def past_len(self) -> int:
        return self.cache_len

    @property
    def num_tokens(self) -> int:
        return len(self.new_ids) + len(self.draft_ids)


Call = Union[PrefillCall, VerifyCall]
Outcome = Union[PrefillOutcome, VerifyOutcome]


@dataclass(frozen=True)
class ForwardInfo:
    """The forward pass that served a call: rows (calls) in it and their real
    (unpadded) input tokens."""

    batch_size: int
    batch_tokens: int
