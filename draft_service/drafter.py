"""Drafters: domain logic that proposes spans of tokens with the exact sparse
distribution q each was sampled from. No gRPC here.

Exactness rests on one invariant (docs/design.md, rule 2): the q returned for a
position is the very distribution its token was drawn from, built by
:func:`specdec.sampling.draft_distribution` and sampled by
:func:`specdec.sampling.sample_sparse`. Greedy drafting returns one-hot q.

Every drafter derives from :class:`Drafter`, whose ``propose`` checks the
arguments once (:class:`DraftRequest`) and calls the drafter's ``draft``. The
model drafters share one autoregressive loop, :class:`DraftLoop`; a drafter
whose model has another vocabulary plugs its logit restriction and id mapping
in through a :class:`VocabHook`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from draft_service.onnx_model import KVCache, OnnxCausalLM
from specdec.errors import InvalidArgument
from specdec.grammar import GrammarState
from specdec.sampling import SamplingConfig, draft_distribution, sample_sparse

logger = logging.getLogger("specdec.draft")


@dataclass
class Proposal:
    """γ' drafted ids and, per position, q as (ids [K] int32, probs [K] float32)."""

    token_ids: list[int]
    q: list[tuple[np.ndarray, np.ndarray]]
    fed_tokens: int = 0  # tokens run through the model (committed refeed + drafted)
    # per drafted token: the draft's largest probability at temperature 1
    # before truncation (1.0 for model-free hits)
    confidence: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # context tokens a fresh state took from the prefix cache instead of feeding


@dataclass(frozen=True)
class DraftRequest:
    """One ``propose`` call's arguments, checked on construction: ``committed``
    holds the whole committed sequence (>= 1 id) and ``num_tokens`` >= 1."""

    committed: Sequence[int]
    num_tokens: int
    cfg: SamplingConfig
    rng: np.random.Generator
    min_confidence: float = 0.0
    # structured output: the grammar state after ``committed``; q at every
    # drafted position is masked by it (docs/design.md rule 10)
    constraint: GrammarState | None = None

    def __post_init__(self) -> None:
        if not self.committed:
            raise InvalidArgument("the committed context is empty")
        if self.num_tokens < 1:
            raise InvalidArgument("num_tokens must be >= 1")


class Drafter(ABC):
    """Proposes target-vocabulary ids. ``vocab_size``: committed and drafted
    ids are < this (the target vocabulary the ids live in). ``inline``: the
    drafter is cheap enough (no model, microseconds) to run on the event loop
    instead of queueing behind model work on the worker thread."""

    name: str
    vocab_size: int
    max_context_tokens: int
    inline: bool = False
    kv_model: OnnxCausalLM | None = None  # the model whose KV the states hold (None: no KV)

    def kv_state(self, state: Any) -> KVState | None:
        """The part of ``state`` holding KV (None for a model-free drafter)."""
        return None

    @abstractmethod
    def new_state(self) -> Any:
        """A fresh per-session drafting state."""

    @abstractmethod
    def draft(self, state: Any, req: DraftRequest) -> Proposal:
        """At most ``req.num_tokens`` ids drafted after ``req.committed``."""

    def pending(self, state: Any, committed: Sequence[int]) -> int:
        """Context tokens a draft on ``committed`` would prefill first (0:
        none, as for a model-free drafter)."""
        return 0

    def catch_up(self, state: Any, committed: Sequence[int], max_tokens: int) -> tuple[int, int, int]:
        """One chunk of that prefill: feeds at most ``max_tokens`` of it; returns
        (tokens fed, tokens still to feed, tokens taken from the prefix cache)."""
        return 0, 0, 0

    def propose(
        self,
        state: Any,
        committed: Sequence[int],
        num_tokens: int,
        cfg: SamplingConfig,
        rng: np.random.Generator,
        min_confidence: float = 0.0,
        constraint: GrammarState | None = None,
    ) -> Proposal:
        """committed: the whole committed sequence (>= 1 token), ids < vocab_size.
        ``constraint``: the grammar state after ``committed`` (drafting may
        advance it; the next call's ``follow`` rolls it back).
        Raises InvalidArgument for an empty context or ``num_tokens`` < 1."""
        return self.draft(state, DraftRequest(committed, num_tokens, cfg, rng, min_confidence, constraint))


@dataclass
class DraftState:
    """The KV cache and the tokens it holds (``len(tokens) == cache.length``)."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)
    hooks: KVHooks | None = None  # the session store's budget and prefix cache

    def reset(self) -> None:
        """Empties the cache and its token list together."""
        self.cache.crop(0)
        self.tokens.clear()


class KVHooks(Protocol):
    """What a session's store lets :class:`DraftLoop` do with its state's KV."""

    def seed(self, state: KVState, context: Sequence[int]) -> int:
        """Fills an empty ``state`` from a stored prefix of ``context`` (at
        most ``len(context) - 1`` tokens); returns how many (0: no hit)."""
        ...

    def reserve(self, state: KVState, tokens: int) -> None:
        """``state`` is about to hold ``tokens``: makes room in the KV budget
        or raises ResourceExhausted (before anything is changed)."""
        ...


class KVState(Protocol):
    """What :class:`DraftLoop` needs of a drafter's state: a KV cache, the
    draft-model ids it holds, and a reset that empties both (and anything
    kept in step with them)."""

    cache: KVCache
    tokens: list[int]
    hooks: KVHooks | None

    def reset(self) -> None: ...


class VocabHook(Protocol):
    """How :class:`DraftLoop` maps the draft model's vocabulary to the ids it
    proposes. Drafting samples *candidates*: indices into ``restrict(logits)``."""

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        """The candidates' logits [M] from the draft model's logits [V_d]."""
        ...

    def target_ids(self, candidates: np.ndarray) -> np.ndarray:
        """Candidate indices [K] -> the ids q is sent over [K]."""
        ...

    def target_id(self, candidate: int) -> int:
        """A sampled candidate -> the id proposed."""
        ...

    def draft_id(self, candidate: int) -> int:
        """A sampled candidate -> the draft-model id fed back to the model."""
        ...


class SameVocab:
    """The identity hook: the draft model drafts in the proposed vocabulary."""

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        return logits

    def target_ids(self, candidates: np.ndarray) -> np.ndarray:
        return candidates

    def target_id(self, candidate: int) -> int:
        return candidate

    def draft_id(self, candidate: int) -> int:
        return candidate


def top_probability(logits: np.ndarray) -> float:
    """Largest softmax probability of raw logits [V] at temperature 1.

    In float32 (the sum in float64): a draft-side estimate for the
    confidence stop, and float64 over a 152k vocabulary cost ~1.5 ms per
    drafted token, ~7 % of the 0.5B draft's own forward pass (0.2 ms now)."""
    x = np.asarray(logits, dtype=np.float32)
    return float(1.0 / np.exp(x - x.max()).sum(dtype=np.float64))


def masked(logits: np.ndarray, allowed: np.ndarray, vocab: VocabHook) -> np.ndarray | None:
    """Candidate logits [M] with -inf where the grammar forbids the proposed
    id (``allowed``: bool over the proposed vocabulary); None when it forbids all."""
    ids = vocab.target_ids(np.arange(logits.shape[0]))
    ok = np.zeros(ids.shape[0], dtype=bool)
    inside = ids < allowed.shape[0]
    ok[inside] = allowed[ids[inside]]
    if not ok.any():
        return None
    return np.where(ok, logits, -np.inf)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, eq=False)
class DraftLoop:
    """The autoregressive drafting loop of the model drafters.

    ``run`` rolls the KV cache back to the longest common prefix of the
    tokens it holds and ``context`` (the draft model's ids), feeds the rest of
    ``context`` (at least the last token, so next-token logits exist), then
    drafts: per position q from the hook's restricted logits
    (:func:`draft_distribution`), one draw from q (:func:`sample_sparse`), the
    draft id fed back. The last drafted token is not fed; the next call's
    common-prefix check keeps whatever the target accepted.
    """

    model: OnnxCausalLM
    max_support: int
    vocab: VocabHook = field(default_factory=SameVocab)
    # a forward takes at most this many context tokens (0 = the whole rest at once): a long
    # context is prefilled in chunks, each its own worker job (DraftLoop.catch_up)
    chunk_tokens: int = 0

    def _seed(self, state: KVState, context: Sequence[int]) -> tuple[int, int]:
        """Seeds a fresh state from the prefix cache; returns (tokens taken
        from it, tokens of ``context`` the cache will keep: its common prefix
        with ``context``, never the last token, whose logits are needed)."""
        cached = 0
        if state.hooks is not None and not state.tokens:  # a fresh (or reset) state: from a stored prefix
            cached = state.hooks.seed(state, context)
        return cached, min(common_prefix_len(state.tokens, context), len(context) - 1)

    def _reserve(self, state: KVState, tokens: int) -> None:
        if state.hooks is not None:
            state.hooks.reserve(state, tokens)

    @staticmethod
    def _roll_back(state: KVState, keep: int) -> None:
        state.cache.crop(keep)
        del state.tokens[keep:]

    def _feed(self, state: KVState, todo: Sequence[int]) -> np.ndarray:
        """Feeds ``todo`` (>= 1 token) in forwards of at most ``chunk_tokens``;
        the last position's logits [V_d]."""
        step = self.chunk_tokens if self.chunk_tokens > 0 else len(todo)
        logits: np.ndarray | None = None
        for i in range(0, len(todo), step):
            part = list(todo[i : i + step])
            logits = self.model.forward(state.cache, part)[-1]
            state.tokens.extend(part)
        assert logits is not None
        return logits

    def pending(self, state: KVState, context: Sequence[int]) -> int:
        """Context tokens a draft on ``context`` would feed before its last
        one (the catch-up prefill still to do; a prefix cache hit not
        counted); 0 when the context does not fit the cache (nothing is drafted)."""
        if len(context) <= 1 or len(context) > self.model.max_cache_tokens:
            return 0
        return len(context) - 1 - min(common_prefix_len(state.tokens, context), len(context) - 1)

    def catch_up(self, state: KVState, context: Sequence[int], max_tokens: int) -> tuple[int, int, int]:
        """Feeds at most ``max_tokens`` (>= 1) of ``context`` (never its last
        token, which the draft call feeds) in one forward: one chunk of a long
        catch-up prefill. Returns (tokens fed, tokens still to feed, tokens
        taken from the prefix cache). A failure resets ``state``."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(context) <= 1 or len(context) > self.model.max_cache_tokens:
            return 0, 0, 0  # nothing to feed (or nothing will be drafted: the context does not fit)
        target = len(context) - 1  # the tokens a draft call would find fed
        cached, keep = self._seed(state, context)
        todo = list(context[keep : min(target, keep + max_tokens)])
        self._reserve(state, keep + len(todo))
        try:
            self._roll_back(state, keep)
            if todo:
                self.model.forward(state.cache, todo)
                state.tokens.extend(todo)
        except Exception:
            state.reset()
            raise
        return len(todo), target - len(state.tokens), cached

    def run(self, state: KVState, context: Sequence[int], req: DraftRequest) -> Proposal:
        """At most ``req.num_tokens`` proposed ids; fewer when the context
        limit is reached or (after the first) a token's confidence is below
        ``req.min_confidence`` (draft-side information only: exactness
        holds); none for an empty ``context``. A failure resets ``state``."""
        # fed tokens = len(context) + γ - 1 must fit the cache
        gamma = min(req.num_tokens, self.model.max_cache_tokens - len(context) + 1)
        if not context or gamma < 1:
            return Proposal([], [])
        cached, keep = self._seed(state, context)
        self._reserve(state, len(context) + gamma - 1)  # what the cache holds at most after the loop
        try:
            self._roll_back(state, keep)
            todo = list(context[keep:])
            logits = self._feed(state, todo)  # [V_d]
            fed = len(todo)
            ids: list[int] = []
            qs: list[tuple[np.ndarray, np.ndarray]] = []
            conf: list[float] = []
            for i in range(gamma):
                x = self.vocab.restrict(logits)  # [M]
                if req.constraint is not None:  # q masked by the grammar state after the tokens so far
                    x = masked(x, req.constraint.allowed(), self.vocab)
                    if x is None:
                        break  # the grammar allows no candidate here
                c = top_probability(x)
                if i > 0 and c < req.min_confidence:
                    break
                cand, probs = draft_distribution(x, req.cfg, self.max_support)  # indices into [M]
                pick = sample_sparse(cand, probs, req.rng)
                if req.constraint is not None:
                    req.constraint.advance(self.vocab.target_id(pick))
                ids.append(self.vocab.target_id(pick))
                qs.append((self.vocab.target_ids(cand), probs))
                conf.append(c)
                if i + 1 < gamma:
                    d = self.vocab.draft_id(pick)
                    logits = self.model.forward(state.cache, [d])[-1]
                    state.tokens.append(d)
                    fed += 1
        except Exception:
            # never leave the cache and the token list out of step
            state.reset()
            raise
        return Proposal(ids, qs, fed, conf, cached)


class OnnxDrafter(Drafter):
    """A same-vocabulary draft model on onnxruntime, drafting with
    :class:`DraftLoop` on the committed ids themselves."""

    inline = False

    def __init__(
        self,
        name: str,
        model: OnnxCausalLM,
        *,
        max_support: int = 64,
        eos_token_ids: Sequence[int] = (),
        prefill_chunk_tokens: int = 0,
    ) -> None:
        """``prefill_chunk_tokens``: the most context tokens one forward takes
        (0 = all at once)."""
        if max_support < 1 or prefill_chunk_tokens < 0:
            raise ValueError("max_support must be >= 1 and prefill_chunk_tokens >= 0")
        self.name = name
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_support = max_support
        self.eos_token_ids = list(eos_token_ids) or list(model.eos_token_ids)
        self.max_context_tokens = model.max_cache_tokens
        self.loop = DraftLoop(model, max_support, chunk_tokens=prefill_chunk_tokens)
        self.kv_model = model

    def new_state(self) -> DraftState:
        return DraftState(cache=self.model.new_state())

    def kv_state(self, state: DraftState) -> DraftState:
        return state

    def draft(self, state: DraftState, req: DraftRequest) -> Proposal:
        """Drafts on ``req.committed``; fewer tokens near the context limit or
        below ``req.min_confidence`` (see :meth:`DraftLoop.run`)."""
        return self.loop.run(state, req.committed, req)

    def pending(self, state: DraftState, committed: Sequence[int]) -> int:
        return self.loop.pending(state, committed)

    def catch_up(self, state: DraftState, committed: Sequence[int], max_tokens: int) -> tuple[int, int, int]:
        return self.loop.catch_up(state, committed, max_tokens)
