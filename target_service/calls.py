"""The target engine's units of work and their results: a Prefill or Verify
call as the batch scheduler (target_service/batching.py) queues it, what the
engine returns for it, and the forward pass that served it. Plain data.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Union

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
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)


@dataclass(frozen=True)
class VerifyOutcome:
    result: VerifyResult
    cache_len: int
    logit_gaps: list[float]  # one per committed token (accepted + next)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the same tokens', when the session asked
    # the grammar allows no token after the accepted ones: result.next_token is not emitted
    dead_end: bool = False
    self_drafted: list[int] = field(default_factory=list)  # the span the engine drafted by lookup, if any


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
    # set by the servicer when the caller is gone (cancel, deadline): a prefill
    # still queued, or running in chunks, stops at its next chunk
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

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
    # decode-ahead prompt lookup (VerifyRequest.ahead_lookup_tokens): a plain
    # call may verify the session's own trusted lookup span, at most this long
    lookup_tokens: int = 0
    self_drafted: bool = False  # draft_ids is that span (set by the engine)

    @property
    def past_len(self) -> int:
        return self.cache_len

    @property
    def num_tokens(self) -> int:
        return len(self.new_ids) + len(self.draft_ids)


@dataclass(frozen=True)
class PrefillChunk:
    """The next part of a prefill that runs in chunks (``prefill_chunk_tokens``):
    the engine answers a chunk that is not the last with
    :class:`target_service.batching.Requeue` of this, and the scheduler puts
    it at the back of its queue, behind the calls that queued meanwhile."""

    call: PrefillCall
    sess: Any  # the engine's TargetSession being filled (not in the session table until its last chunk)
    done: int  # prompt tokens already in its cache
    chunk: int  # prompt tokens per forward

    @property
    def session_id(self) -> str:
        return str(self.sess.session_id)

    @property
    def past_len(self) -> int:
        return self.done

    @property
    def num_tokens(self) -> int:
        return min(self.chunk, len(self.call.token_ids) - self.done)

    def abandon(self) -> None:
        """The scheduler's caller is gone: the next chunk stops and frees the reservation."""
        self.call.cancel.set()


Call = Union[PrefillCall, VerifyCall, PrefillChunk]
Outcome = Union[PrefillOutcome, VerifyOutcome]


@dataclass(frozen=True)
class ForwardInfo:
    """The forward pass that served a call: rows (calls) in it and their real
    (unpadded) input tokens."""

    batch_size: int
    batch_tokens: int
