"""Drafters: domain logic that proposes spans of tokens with the exact sparse
distribution q each was sampled from. No gRPC here.

Exactness rests on one invariant (docs/design.md, rule 2): the q returned for a
position is the very distribution its token was drawn from, built by
:func:`specdec.sampling.draft_distribution` and sampled by
:func:`specdec.sampling.sample_sparse`. Greedy drafting returns one-hot q.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from draft_service.onnx_model import KVCache, OnnxCausalLM
from specdec.errors import InvalidArgument
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


class Drafter(Protocol):
    """Proposes target-vocabulary ids. ``vocab_size``: committed and drafted
    ids are < this (the target vocabulary the ids live in). ``inline``: the
    drafter is cheap enough (no model, microseconds) to run on the event loop
    instead of queueing behind model work on the worker thread."""

    name: str
    vocab_size: int
    max_context_tokens: int
    inline: bool

    def new_state(self) -> Any: ...

    def propose(
        self,
        state: Any,
        committed: Sequence[int],
        num_tokens: int,
        cfg: SamplingConfig,
        rng: np.random.Generator,
        min_confidence: float = 0.0,
    ) -> Proposal: ...


@dataclass
class DraftState:
    """The KV cache and the tokens it holds (``len(tokens) == cache.length``)."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)


def top_probability(logits: np.ndarray) -> float:
    """Largest softmax probability of raw logits [V] at temperature 1."""
    x = logits.astype(np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class OnnxDrafter:
    """A same-vocabulary draft model on onnxruntime.

    ``propose`` rolls the KV cache back to the longest common prefix of the
    tokens it holds and ``committed``, feeds the rest of ``committed`` (at
    least the last token, so next-token logits exist), then drafts
    autoregressively. The last drafted token is not fed; the next call's
    common-prefix check keeps whatever the target accepted.
    """

    inline = False

    def __init__(
        self,
        name: str,
        model: OnnxCausalLM,
        *,
        max_support: int = 64,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        if max_support < 1:
            raise ValueError("max_support must be >= 1")
        self.name = name
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_support = max_support
        self.eos_token_ids = list(eos_token_ids) or list(model.eos_token_ids)
        self.max_context_tokens = model.max_cache_tokens

    def new_state(self) -> DraftState:
        return DraftState(cache=self.model.new_state())

    def propose(
        self,
        state: DraftState,
        committed: Sequence[int],
        num_tokens: int,
        cfg: SamplingConfig,
        rng: np.random.Generator,
        min_confidence: float = 0.0,
    ) -> Proposal:
        """committed: the whole committed sequence (>= 1 token), ids < vocab_size.
        Returns at most ``num_tokens`` tokens; fewer when the context limit is
        reached or (after the first) a token's confidence is below
        ``min_confidence`` (draft-side information only: exactness holds)."""
        if not committed:
            raise InvalidArgument("the committed context is empty")
        if num_tokens < 1:
            raise InvalidArgument("num_tokens must be >= 1")
        # fed tokens = len(committed) + γ - 1 must fit the cache
        gamma = min(num_tokens, self.max_context_tokens - len(committed) + 1)
        if gamma < 1:
            return Proposal([], [])
        keep = min(common_prefix_len(state.tokens, committed), len(committed) - 1)
        try:
            state.cache.crop(keep)
            del state.tokens[keep:]
            todo = list(committed[keep:])
            logits = self.model.forward(state.cache, todo)[-1]  # [V]
            state.tokens.extend(todo)
            fed = len(todo)
            ids: list[int] = []
            qs: list[tuple[np.ndarray, np.ndarray]] = []
            conf: list[float] = []
            for i in range(gamma):
                c = top_probability(logits)
                if i > 0 and c < min_confidence:
                    break
                q_ids, q_probs = draft_distribution(logits, cfg, self.max_support)
                x = sample_sparse(q_ids, q_probs, rng)
                ids.append(x)
                qs.append((q_ids, q_probs))
                conf.append(c)
                if i + 1 < gamma:
                    logits = self.model.forward(state.cache, [x])[-1]
                    state.tokens.append(x)
                    fed += 1
        except Exception:
            # never leave the cache and the token list out of step
            state.cache.crop(0)
            state.tokens.clear()
            raise
        return Proposal(ids, qs, fed, conf)
