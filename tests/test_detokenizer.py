"""Incremental detokenization and stop strings, on a byte-level tokenizer
(one token per UTF-8 byte: the case where characters split across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.detokenizer import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Token id = byte value; decoding is UTF-8 with U+FFFD for partial bytes,
    as byte-level BPE tokenizers (Qwen, GPT-2) behave."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:  # noqa: ANN001
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mix", "ä"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_text_is_whole_utf8_and_complete(text: str, chunk: int) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    pieces = []
    for i in range(0, len(ids), chunk):
        piece = detok.push(ids[i : i + chunk])
        assert "\ufffd" not in piece  # never a half character
        pieces.append(piece)
    pieces.append(detok.flush())
    assert "".join(pieces) == text


def test_flush_emits_trailing_incomplete_bytes_as_replacement() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(tok.encode("ok")) == "ok"
    assert detok.push(tok.encode("é")[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_split_across_pushes_is_never_shown() -> None:
    m = StopMatcher(["STOP"])
    out = m.push("hello S") + m.push("TO")
    assert out == "hello "
    assert not m.stopped
    out += m.push("P and more")
    assert m.stopped and out == "hello "
    assert m.push("later") == ""


def test_held_back_prefix_is_released_when_it_does_not_match() -> None:
    m = StopMatcher(["</end>"])
    assert m.push("a </e") == "a "
    assert m.push("x") == "</ex"
    assert m.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["bb", "a"])
    assert m.push("xxbbya") == "xx"
    assert m.stopped


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""


# ------------------------------------------------ stop strings: exactness
def reference_stop(text: str, stops: list[str]) -> str | None:
    """The text before the first stop string to complete in ``text`` (of
    those completing at the same character, the longest); None: no stop."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))]
    return None


def reference_held(text: str, stops: list[str]) -> int:
    """How much of ``text`` could still be the start of a stop string."""
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


def run_matcher(stops: list[str], pieces: list[str]) -> tuple[list[str], StopMatcher]:
    m = StopMatcher(stops)
    return [m.push(p) for p in pieces], m


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab\u00e9", min_size=1, max_size=5), min_size=1, max_size=4),
    pieces=st.lists(st.text(alphabet="ab\u00e9c", max_size=6), max_size=8),
)
def test_the_matcher_agrees_with_the_reference_however_the_text_is_split(stops: list[str], pieces: list[str]) -> None:
    """Stop strings split over pushes, several stops, stops overlapping each
    other or themselves (a small alphabet makes all of these common): what
    is sent is always a prefix of the answer, what is held back is exactly
    what could still start a stop string, and the result does not depend on
    the split."""
    outs, m = run_matcher(stops, pieces)
    text = "".join(pieces)
    want = reference_stop(text, stops)
    sent = ""
    for i, out in enumerate(outs):
        sent += out
        so_far = "".join(pieces[: i + 1])
        if reference_stop(so_far, stops) is None:
            assert sent == so_far[: len(so_far) - reference_held(so_far, stops)]
    sent += m.flush()
    if want is None:
        assert not m.stopped and sent == text
    else:
        assert m.stopped and sent == want
    whole, m1 = run_matcher(stops, [text])
    assert "".join(whole) + m1.flush() == sent


@pytest.mark.parametrize(
    "stops,pieces,sent",
    [
        (["abcd", "bc"], ["abcd"], "a"),  # "bc" completes first
        (["abcd", "bc"], ["ab", "cd"], "a"),  # the same, however it is split
        (["xab", "ab"], ["x", "ab"], "x"[:0]),  # both complete at 'b': the longest wins
        (["aab"], ["a", "a", "a", "b"], "a"),  # a stop overlapping itself
        (["</end>", "<e"], ["text </", "e", "nd>"], "text "),
    ],
)
def test_overlapping_stops(stops: list[str], pieces: list[str], sent: str) -> None:
    outs, m = run_matcher(stops, pieces)
    assert m.stopped and "".join(outs) == sent


def test_work_per_push_is_bounded_by_the_new_text() -> None:
    """16 stop strings of 256 characters whose prefixes keep matching (the
    worst case for scanning every prefix of every stop): the matcher's steps
    stay within twice the text pushed, and it keeps only the held-back
    suffix (at most the longest stop string), not the whole text."""
    stops = ["a" * 255 + chr(ord("b") + i) for i in range(16)]
    m = StopMatcher(stops)
    pushed = 0
    for i in range(3000):
        delta = "a" * (i % 7) + ("x" if i % 50 == 49 else "")
        pushed += len(delta)
        m.push(delta)
        assert len(m.held) < 256
        assert m.work <= 2 * pushed
    assert not m.stopped
    assert m.push("a" * 255 + "!").endswith("a" * 255 + "!") and m.held == ""
    assert m.push("a" * 255 + "c") == "" and m.stopped


def test_push_tokens_counts_the_tokens_up_to_the_one_that_completes_the_stop() -> None:
    """The token ids returned with a stop string end at the token whose text
    completed it, also when a character spans several tokens (é is two
    bytes here, and its first byte alone shows no text)."""
    tok = ByteTokenizer()
    prompt = tok.encode("p: ")
    ids = tok.encode("abé!xyz")
    m = StopMatcher(["é!"])
    text, kept = m.push_tokens(IncrementalDetokenizer(tok, prompt), ids)
    assert (text, kept, m.stopped) == ("ab", 5, True)
    m = StopMatcher(["\u00e9"])  # completed by é's second byte
    text, kept = m.push_tokens(IncrementalDetokenizer(tok, prompt), ids)
    assert (text, kept) == ("ab", 4)
    m = StopMatcher(["never"])
    detok = IncrementalDetokenizer(tok, prompt)
    text, kept = m.push_tokens(detok, ids[:3])  # "ab" and half of é
    assert (text, kept) == ("ab", 3)
    assert m.push_tokens(detok, ids[3:]) == ("é!xyz", 5)
