"""Structured output: grammars (JSON schema, any JSON object, regex, Lark)
compiled with llguidance for one tokenizer, and the per-sequence state that
says which tokens may come next.

Both model services keep a :class:`GrammarState` per session that follows
the request's generated tokens: the target masks its distribution p with it
at every position it verifies (advancing along the drafted span, rolling back
to the committed prefix afterwards), the draft masks q the same way, and
target-only decoding applies the same mask, so the constrained distribution
is the reference (docs/design.md rule 10). The mask is applied to the logits
before temperature, top-k and top-p (as vLLM applies its grammar bitmask).

Compiled grammars are cached by content hash (sha256 of kind and source) in
a bounded LRU; a session's state is a copy of the cached initial matcher.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from specdec.errors import FailedPrecondition, InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON is written as Python's json.dumps writes it (", " and ": ", no other
# whitespace): free whitespace lets a model pad forever. A schema's own
# "x-guidance" options (e.g. {"whitespace_flexible": true}) override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match. ``source``: the JSON schema
    text, the regex or the Lark grammar ("" for json_object)."""

    kind: str
    source: str = ""

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @classmethod
    def from_proto(cls, msg: Any) -> "GrammarSpec | None":
        """From a ``specdec.v1.Grammar`` (None when no kind is set)."""
        if msg is None:
            return None
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not msg.json_object:
                raise InvalidArgument("structured output: json_object must be true when set")
            return cls("json_object")
        source = getattr(msg, kind)
        if not source:
            raise InvalidArgument(f"structured output: {kind} is empty")
        if len(source) > MAX_GRAMMAR_CHARS:
            raise InvalidArgument(f"structured output: {kind} of {len(source)} characters exceeds {MAX_GRAMMAR_CHARS}")
        return cls(kind, source)

    def to_proto(self, msg: Any) -> None:
        """Sets this spec on a ``specdec.v1.Grammar`` message."""
        if self.kind == "json_object":
            msg.json_object = True
        else:
            setattr(msg, self.kind, self.source)


def _grammar_text(spec: GrammarSpec) -> str:
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        try:
            return LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise InvalidArgument(f"structured output: json_schema: {e}") from None
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    raise InvalidArgument(f"structured output: unknown kind {spec.kind!r} (one of {', '.join(KINDS)})")


class GrammarCompiler:
    """Compiles grammars for one tokenizer; ``vocab_size`` is the logits'
    size (ids past the tokenizer's are never allowed) and ``eos_ids`` the
    tokens that end a sequence the grammar accepts."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], max_cached: int = 64) -> None:
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.eos_ids = sorted(set(int(e) for e in eos_ids))
        # what llguidance.hf.from_tokenizer does, without its isinstance check
        # (transformers 5's tokenizer classes are not PreTrainedTokenizerFast)
        backend = copy.copy(getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer"))
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                     eos_token=self.eos_ids or getattr(tokenizer, "eos_token_id", None))
        self.max_cached = max_cached
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compilations (cache misses)

    def _compile(self, spec: GrammarSpec) -> Any:
        from llguidance import LLMatcher

        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        matcher = LLMatcher(self.tokenizer, _grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"structured output: {spec.kind} does not compile: {matcher.get_error()}")
        with self._lock:
            self.compiled += 1
            self._cache[spec.key] = matcher
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return matcher

    def state(self, spec: GrammarSpec, start: int) -> "GrammarState":
        """A fresh state for one sequence whose generated tokens begin at
        index ``start`` (the prompt's length). InvalidArgument, with
        llguidance's message, for a grammar that does not compile."""
        initial = self._compile(spec)
        return GrammarState(initial.deep_copy(), self.vocab_size, start, tuple(self.eos_ids), initial=initial)

    @property
    def cached(self) -> int:
        return len(self._cache)


@dataclass
class GrammarState:
    """The grammar state after ``consumed`` (the sequence's tokens from index
    ``start`` on, as far as this state has followed them). Once the grammar
    has ended (an EOS consumed in an accepting state) only EOS is allowed:
    a sequence that goes on past EOS (``ignore_eos``) repeats it."""

    matcher: Any
    vocab_size: int
    start: int
    eos_ids: tuple[int, ...] = ()
    consumed: list[int] = field(default_factory=list)
    after_stop: int = 0  # trailing EOS tokens followed after the matcher stopped (not given to it)
    initial: Any = None  # the compiled grammar's initial matcher (shared; never advanced)

    def _stopped(self) -> bool:
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows next (all False
        at a dead end)."""
        if self.matcher.is_error():
            return np.zeros(self.vocab_size, dtype=bool)
        if self._stopped():
            out = np.zeros(self.vocab_size, dtype=bool)
            out[[e for e in self.eos_ids if e < self.vocab_size]] = True
            return out
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            # llguidance found no token that extends the output (a dead end) and
            # left its matcher in an error state, which cannot roll back: replay
            # the tokens on a fresh copy, so that callers can still roll back
            self._replay()
            return np.zeros(self.vocab_size, dtype=bool)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def _replay(self) -> None:
        if self.initial is None:
            return
        self.matcher = self.initial.deep_copy()
        real = self.consumed[: len(self.consumed) - self.after_stop]
        if real and not self.matcher.consume_tokens(real):
            raise FailedPrecondition("structured output: the grammar state could not be replayed")

    def advance(self, token: int) -> bool:
        """Consumes ``token`` if the grammar allows it (True); else leaves the state as it was (False)."""
        token = int(token)
        if self._stopped():
            if token not in self.eos_ids:
                return False
            self.after_stop += 1
        elif self.matcher.validate_tokens([token]) != 1 or not self.matcher.consume_token(token):
            return False
        self.consumed.append(token)
        return True

    def follow_allowed(self, tokens: Sequence[int], position: int) -> int:
        """:meth:`follow` for tokens the caller drew from this state's masks:
        how many of them the grammar took (all, unless llguidance's mask let
        through a token its parser then refuses, which happens only with a
        vocabulary that lacks bytes the grammar needs; the rest is dropped)."""
        for i in range(len(tokens)):
            try:
                self.follow(tokens[i : i + 1], position + i)
            except InvalidArgument:
                return i
        return len(tokens)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (the state is unchanged)."""
        if not tokens or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def rollback(self, n: int) -> None:
        """Forgets the last ``n`` consumed tokens."""
        if n <= 0:
            return
        if n > len(self.consumed):
            raise FailedPrecondition(f"structured output: cannot roll the grammar back {n} tokens")
        extra = min(n, self.after_stop)
        if n > extra and not self.matcher.rollback(n - extra):
            raise FailedPrecondition(f"structured output: cannot roll the grammar back {n} tokens")
        self.after_stop -= extra
        del self.consumed[-n:]

    def follow(self, tokens: Sequence[int], position: int) -> None:
        """Makes the state follow a sequence whose tokens at ``position``,
        ``position + 1``, ... are ``tokens`` (the caller's are authoritative:
        a consumed token that differs is rolled back). InvalidArgument when
        the grammar does not allow one of them; FailedPrecondition when they
        leave a gap after what this state has followed."""
        for i, t in enumerate(tokens):
            idx = position + i - self.start
            if idx < 0:
                continue  # a prompt token
            if idx < len(self.consumed):
                if self.consumed[idx] == int(t):
                    continue
                self.rollback(len(self.consumed) - idx)
            if idx > len(self.consumed):
                raise FailedPrecondition(f"structured output: token at position {position + i} leaves a gap after "
                                         f"the {self.start + len(self.consumed)} tokens the grammar has followed")
            if not self.advance(int(t)):
                raise InvalidArgument(f"structured output: token {int(t)} at position {position + i} is not allowed "
                                      "by the grammar")

    def truncate(self, length: int) -> None:
        """Rolls back to the sequence's first ``length`` tokens."""
        self.rollback(len(self.consumed) - max(0, length - self.start))


class LazyGrammarCompiler:
    """A :class:`GrammarCompiler` built on first use (wrapping a large
    vocabulary takes about a second, which services without structured
    output requests never pay). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], max_cached: int = 64) -> None:
        self._args = (tokenizer, vocab_size, list(eos_ids), max_cached)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def state(self, spec: GrammarSpec, start: int) -> GrammarState:
        return self.compiler.state(spec, start)
