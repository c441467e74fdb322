"""UTF-8-safe incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` follows text-generation-inference: decode a short
window of already-read tokens plus the new ones, and emit only the part past
the window, holding back text that ends in an incomplete UTF-8 sequence
(rendered as U+FFFD by the tokenizer) until it is whole.
"""

from __future__ import annotations

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


class StopMatcher:
    """Finds stop strings in streamed text and holds back any suffix that could
    still become one, so a client never sees part of a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """Returns the text safe to send now; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        longest = max(len(s) for s in self.stops)
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.sent : end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            self.stopped = True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
