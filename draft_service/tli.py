"""Different-tokenizer drafting by token-level intersection (TLI).

A draft model with its own tokenizer proposes tokens for a target with
another tokenizer (docs/design.md, "Different tokenizers"):

1. *Context.* The draft's context is the target's committed text: the
   committed target ids are turned into bytes with the target's id -> bytes
   table (so target tokens outside the intersection, special tokens included,
   reach the draft as their exact text, never as UNK), and that text is
   re-tokenized with the draft tokenizer. Only a look-behind window at the end
   is re-tokenized each round (:class:`RetokenizedContext`); the draft KV
   cache is rolled back to the longest common prefix of the draft ids it holds
   and the new re-tokenization.
2. *Drafting.* The draft distribution is restricted to draft tokens whose
   bytes are also a target token (the intersection, :mod:`draft_service.vocab_map`)
   and renormalised; temperature, top-k and top-p then apply exactly as
   :func:`specdec.sampling.draft_distribution` applies them. The sampled draft
   id is fed back to the draft model, and its target id is proposed. Because
   the map is a bijection on the intersection, the sparse q over draft ids is
   the same sparse q over target ids: the q sent is the q sampled (rule 2),
   so verification stays exact for sampling and greedy alike.

Chat templates: the target renders chat messages with its own template and
the draft only ever sees the resulting committed *text* (e.g. Qwen's
``<|im_start|>user ...``). A draft whose tokenizer knows the same control
tokens (SmolLM2 also uses ChatML) reads them as its own special tokens;
otherwise it reads them as plain text. Either way exactness is untouched;
only acceptance depends on how familiar the rendered text is to the draft.

Text rendering: committed bytes that end inside a UTF-8 character are held
back until the character completes; invalid UTF-8 inside the text becomes
U+FFFD (the draft tokenizer takes text).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from draft_service.drafter import Drafter, DraftLoop, DraftRequest, KVHooks, Proposal, common_prefix_len
from draft_service.onnx_model import KVCache, OnnxCausalLM
from draft_service.vocab_map import TokenTable, VocabMap

logger = logging.getLogger("specdec.draft.tli")

Tokenize = Callable[[str], list[int]]


def utf8_complete_prefix(data: bytes | bytearray) -> int:
    """Length of ``data`` without a trailing, not yet complete UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return n - back if back < need else n
    return n


def render_text(data: bytes | bytearray) -> bytes:
    """The UTF-8 bytes of the text the draft sees for committed bytes ``data``:
    an incomplete trailing character is held back, invalid bytes become U+FFFD."""
    return bytes(data[: utf8_complete_prefix(data)]).decode("utf-8", errors="replace").encode("utf-8")


def hf_tokenize_fn(tokenizer: Any) -> Tokenize:
    """text -> draft ids with the tokenizer's ``tokenizers`` backend, no
    BOS/EOS added; special tokens written in the text are recognised."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode"):
        return lambda text: list(backend.encode(text, add_special_tokens=False).ids)
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class RetokenizedContext:
    """The draft-tokenizer view of a committed target-token sequence.

    ``update(committed)`` returns the draft ids of the committed text. Draft
    tokens ending more than ``lookbehind`` tokens before the end, inside the
    unchanged byte prefix and on a character boundary, are kept; the rest of
    the text is re-tokenized. ``ends[i]`` is the byte end of draft token i in
    the rendered text. When the draft tokenizer does not reproduce its input
    bytes (e.g. a normalizer rewrote them) the context falls back to
    re-tokenizing the whole text each round, which is always correct.
    """

    target: TokenTable
    draft: TokenTable
    tokenize: Tokenize
    lookbehind: int = 8
    target_ids: list[int] = field(default_factory=list)
    target_ends: list[int] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)
    text: bytes = b""
    draft_ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    invertible: bool = True
    retokenized_tokens: int = 0  # draft tokens produced by re-tokenization (cost counter)

    def fresh(self) -> RetokenizedContext:
        """An empty context with the same tables, tokenizer and look-behind."""
        return RetokenizedContext(self.target, self.draft, self.tokenize, self.lookbehind)

    def _draft_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.draft.get(i) for i in ids)

    def update(self, committed: Sequence[int]) -> list[int]:
        k = common_prefix_len(self.target_ids, committed)
        del self.target_ids[k:]
        del self.target_ends[k:]
        del self.raw[self.target_ends[-1] if self.target_ends else 0 :]
        for t in committed[k:]:
            self.raw += self.target.get(int(t))
            self.target_ids.append(int(t))
            self.target_ends.append(len(self.raw))
        new_text = render_text(self.raw)
        old = self.text
        p = len(old) if new_text.startswith(old) else common_prefix_len(old, new_text)  # type: ignore[arg-type]
        keep = 0
        if self.invertible:
            keep = min(len(self.draft_ids) - self.lookbehind, bisect.bisect_right(self.ends, p))
            while keep > 0:
                c = self.ends[keep - 1]
                if c >= len(new_text) or new_text[c] & 0xC0 != 0x80:
                    break
                keep -= 1
            keep = max(keep, 0)
        cut = self.ends[keep - 1] if keep else 0
        ids = self.tokenize(new_text[cut:].decode("utf-8"))
        self.retokenized_tokens += len(ids)
        if self.invertible and self._draft_bytes(ids) != new_text[cut:]:
            self.invertible = False
            if cut:
                ids = self.tokenize(new_text.decode("utf-8"))
                keep, cut = 0, 0
        del self.draft_ids[keep:]
        del self.ends[keep:]
        self.draft_ids.extend(ids)
        if self.invertible:
            pos = cut
            for i in ids:
                pos += len(self.draft.get(i))
                self.ends.append(pos)
        self.text = new_text
        return list(self.draft_ids)


@dataclass
class TliState:
    """A TLI session: the re-tokenized context, the draft KV cache and the draft ids it holds."""

    context: RetokenizedContext
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # draft ids held by ``cache``
    hooks: KVHooks | None = None  # the session store's budget and prefix cache (keyed by draft ids)

    def reset(self) -> None:
        """Empties the cache and its token list and starts a new context:
        never out of step with one another."""
        self.cache.crop(0)
        self.tokens.clear()
        self.context = self.context.fresh()


@dataclass(frozen=True, eq=False)
class Intersection:
    """The :class:`~draft_service.drafter.VocabHook` of TLI: candidates are
    the draft tokens whose bytes are also a target token, ``draft[i]`` and
    ``target[i]`` the two ids of candidate i."""

    draft: np.ndarray  # [M] int64 draft ids in the intersection
    target: np.ndarray  # [M] int32 their target ids

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        return logits[self.draft].astype(np.float64)

    def target_ids(self, candidates: np.ndarray) -> np.ndarray:
        return self.target[candidates]

    def target_id(self, candidate: int) -> int:
        return int(self.target[candidate])

    def draft_id(self, candidate: int) -> int:
        return int(self.draft[candidate])


class TliDrafter(Drafter):
    """A draft model with another tokenizer, drafting in the target vocabulary.

    ``vocab_size`` and the ids it takes and returns are the TARGET's;
    ``draft_vocab_size`` is the draft model's logits size.
    """

    inline = False

    def __init__(
        self,
        name: str,
        model: OnnxCausalLM,
        vocab_map: VocabMap,
        tokenize: Tokenize,
        *,
        target_vocab_size: int,
        max_support: int = 64,
        lookbehind: int = 8,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        if max_support < 1 or lookbehind < 0:
            raise ValueError("max_support must be >= 1 and lookbehind >= 0")
        if vocab_map.draft_to_target.shape[0] != model.vocab_size:
            raise ValueError(
                f"vocab map covers {vocab_map.draft_to_target.shape[0]} draft ids, the model has {model.vocab_size}"
            )
        self.name = name
        self.model = model
        self.map = vocab_map
        self.tokenize = tokenize
        self.vocab_size = target_vocab_size
        self.draft_vocab_size = model.vocab_size
        self.max_support = max_support
        self.lookbehind = lookbehind
        self.max_context_tokens = model.max_cache_tokens
        inter = np.nonzero(vocab_map.draft_to_target >= 0)[0]
        if inter.size == 0:
            raise ValueError("the draft and target vocabularies do not intersect")
        self.inter_target = vocab_map.draft_to_target[inter].astype(np.int32)  # [M] target ids of the intersection
        self.loop = DraftLoop(model, max_support, Intersection(inter.astype(np.int64), self.inter_target),
                              chunk_tokens=prefill_chunk_tokens)
        self.kv_model = model

    def kv_state(self, state: TliState) -> TliState:
        return state

    def new_state(self) -> TliState:
        ctx = RetokenizedContext(self.map.target, self.map.draft, self.tokenize, self.lookbehind)
        return TliState(ctx, self.model.new_state())

    def draft(self, state: TliState, req: DraftRequest) -> Proposal:
        """Drafts on the re-tokenized committed text: at most
        ``req.num_tokens`` target ids with q over target ids; none when the
        committed text is empty so far or the draft context is full."""
        return self.loop.run(state, self._context(state, req.committed), req)

    def _context(self, state: TliState, committed: Sequence[int]) -> list[int]:
        try:
            return state.context.update(committed)
        except Exception:
            state.reset()
            raise

    def pending(self, state: TliState, committed: Sequence[int]) -> int:
        return self.loop.pending(state, self._context(state, committed))

    def catch_up(self, state: TliState, committed: Sequence[int], max_tokens: int) -> tuple[int, int, int]:
        return self.loop.catch_up(state, self._context(state, committed), max_tokens)
