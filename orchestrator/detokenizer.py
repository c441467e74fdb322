"""UTF-8-safe incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` follows text-generation-inference: decode a short
window of already-read tokens plus the new ones, and emit only the part past
the window, holding back text that ends in an incomplete UTF-8 sequence
(rendered as U+FFFD by the tokenizer) until it is whole.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], window: int = 5) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - window)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text that became complete."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (possibly with U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


@dataclass(frozen=True)
class _Automaton:
    """Aho-Corasick over the stop strings: ``goto[n]`` the trie edges of node
    n, ``fail[n]`` the node of n's longest proper suffix that is in the trie,
    ``depth[n]`` the length of n's string, ``match[n]`` the length of the
    longest stop string that ends at n (itself or a suffix), 0 if none."""

    goto: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    depth: tuple[int, ...]
    match: tuple[int, ...]


@lru_cache(maxsize=256)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    """Built once per distinct stop set (the work is linear in their total
    length, at most max_stop_strings x max_stop_string_chars)."""
    goto: list[dict[str, int]] = [{}]
    depth, terminal = [0], [False]
    for s in stops:
        n = 0
        for ch in s:
            nxt = goto[n].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[n][ch] = nxt
                goto.append({})
                depth.append(depth[n] + 1)
                terminal.append(False)
            n = nxt
        terminal[n] = True
    fail, match = [0] * len(goto), [0] * len(goto)
    queue = deque(goto[0].values())
    while queue:
        n = queue.popleft()
        match[n] = depth[n] if terminal[n] else match[fail[n]]
        for ch, child in goto[n].items():
            f = fail[n]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[child] = goto[f].get(ch, 0)
            queue.append(child)
    return _Automaton(tuple(goto), tuple(fail), tuple(depth), tuple(match))


class StopMatcher:
    """Finds stop strings in streamed text and holds back any suffix that could
    still become one, so a client never sees part of a stop string.

    Generation stops at the first stop string to *complete* in the text (of
    several completing at the same character, the longest), and the text
    ends just before it: the result does not depend on how the text was
    split into pushes. The matcher is an Aho-Corasick automaton, so a push
    costs O(len(delta)) amortised, whatever the number and length of the
    stop strings (``work`` counts the steps), and it keeps only the held-back
    suffix, not the whole text."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._ac = _automaton(tuple(self.stops)) if self.stops else None
        self._state = 0
        self.held = ""  # received, not sent: the longest suffix that is a prefix of a stop string
        self.stopped = False
        self.work = 0  # automaton steps taken (characters + failure links followed)

    def push(self, delta: str) -> str:
        """Returns the text safe to send now; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if self._ac is None:
            return delta
        goto, fail, match = self._ac.goto, self._ac.fail, self._ac.match
        state, work = self._state, len(delta)
        for i, ch in enumerate(delta):
            while state and ch not in goto[state]:
                state = fail[state]
                work += 1
            state = goto[state].get(ch, 0)
            if match[state]:
                text = self.held + delta[: i + 1]
                self.work += work
                self.stopped, self.held = True, ""
                return text[: len(text) - match[state]]
        self.work += work
        self._state = state
        text = self.held + delta
        keep = self._ac.depth[state]
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def push_tokens(self, detok: IncrementalDetokenizer, ids: Sequence[int]) -> tuple[str, int]:
        """Detokenizes ``ids`` and matches the text. Returns the text safe to
        send and how many of ``ids`` produced it: all of them, or on a stop
        match those up to and including the token whose text completed the
        stop string (the rest are dropped, so token ids and text agree).
        With stop strings the tokens are decoded one at a time to find it."""
        if self._ac is None or self.stopped:
            return self.push(detok.push(ids)), (0 if self.stopped else len(ids))
        out = []
        for n, t in enumerate(ids, 1):
            out.append(self.push(detok.push([t])))
            if self.stopped:
                return "".join(out), n
        return "".join(out), len(ids)

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self.held = self.held, ""
        return out
