"""Incremental detokenization and stop strings, on a byte-level tokenizer
(one token per UTF-8 byte: the case where characters split across tokens)."""

from __future__ import annotations

import pytest

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
