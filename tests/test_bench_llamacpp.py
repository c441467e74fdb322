"""scripts/bench_llamacpp.py's readers of llama.cpp's output (no llama.cpp
needed): the server's streamed /completion events and
llama-speculative-simple's summary, in the formats llama.cpp 11434 prints."""

from __future__ import annotations

import json

import pytest

from tests.stack import load_script


@pytest.fixture(scope="module")
def mod():  # type: ignore[no-untyped-def]
    return load_script("bench_llamacpp")


def sse(event: dict) -> list[bytes]:  # type: ignore[type-arg]
    return [b"data: " + json.dumps(event).encode() + b"\n", b"\n"]


def test_a_streamed_completion_gives_ids_text_first_token_time_and_timings(mod) -> None:  # type: ignore[no-untyped-def]
    timings = {"prompt_n": 30, "prompt_ms": 210.0, "predicted_n": 3, "predicted_ms": 90.0, "draft_n": 4,
               "draft_n_accepted": 3}
    lines = (sse({"content": "", "tokens": [], "stop": False, "prompt_progress": {"processed": 30}})
             + sse({"content": "Hel", "tokens": [9707], "stop": False})
             + sse({"content": "lo world", "tokens": [1, 1879], "stop": False})
             + sse({"content": "", "tokens": [], "stop": True, "stop_type": "eos", "timings": timings})
             + sse({"content": "after the end", "tokens": [5], "stop": False}))
    clock = iter([0.25, 9.0])  # read at the first event that carries tokens only
    run = mod.read_stream(lines, 0.0, clock=lambda: next(clock))
    assert run == {"token_ids": [9707, 1, 1879], "text": "Hello world", "first_token_s": 0.25,
                   "timings": timings, "stop_type": "eos"}


def test_the_speculative_simple_summary_is_parsed(mod) -> None:  # type: ignore[no-untyped-def]
    log = ("main: prompt: 'x'\n\n\n"
           "encoded   41 tokens in    0.500 seconds, speed:   82.000 t/s\n"
           "decoded  130 tokens in    6.000 seconds, speed:   21.667 t/s\n\n"
           "n_draft   = 4\nn_predict = 130\nn_drafted = 120\nn_accept  = 90\naccept    = 75.000%\n\n"
           "draft:\n\nstatistics draft: #calls(b,g,a) = 1 40 30, #gen drafts = 40, #acc drafts = 30\n")
    r = mod.parse_simple(log)
    assert (r["encoded_tokens"], r["tokens"], r["draft_tokens"], r["accepted_tokens"]) == (41, 130, 120, 90)
    assert r["acceptance_rate"] == 0.75 and r["ttft_ms"] == 500.0
    assert r["tok_s"] == pytest.approx(130 / 6.5) and r["decode_tok_s"] == pytest.approx(130 / 6.0)
    with pytest.raises(ValueError, match="n_drafted"):
        mod.parse_simple(log.replace("n_drafted", "n_dr"))


def test_first_divergence(mod) -> None:  # type: ignore[no-untyped-def]
    assert mod.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert mod.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert mod.first_divergence([1, 2, 3], [1, 2]) == 2
