"""Issue 26's measurement scripts on the tiny stack: scripts/long_prompt_bench.py
(TTFT against prompt length, the co-tenant gap, prefix reuse) and
scripts/chat_soak.py (concurrent multi-turn chats: completion, lost sessions,
KV usage, RSS), each launching `specdec up` as separate processes, at tiny
sizes. The figures are the lead's to take on real models; here the reports'
shape and the facts that do not depend on timing are checked."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.stack import load_script
from tests.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def longctx() -> ModuleType:
    return load_script("longctx")


def tiny_args(tiny_models: Any, cache: Path, out: Path) -> list[str]:
    return ["--tiny", "--target-model", str(tiny_models.target), "--draft-model", str(tiny_models.draft),
            "--cache-dir", str(cache), "--out", str(out)]


def test_long_prompt_bench_tiny(tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bench = load_script("long_prompt_bench")
    out = tmp_path / "lp"
    rc = bench.main(tiny_args(tiny_models, onnx_cache_dir, out) + [
        "--lengths", "20,90", "--repeats", "1", "--cotenant-prompt-tokens", "200", "--cotenant-stream-tokens", "400",
        "--cotenant-lead-chunks", "4", "--cotenant-tail-chunks", "4", "--chat-history-tokens", "100",
        "--reply-tokens", "8", "--system-prompt-tokens", "60"])
    assert rc == 0
    res = json.loads((out / "long_prompt.json").read_text())
    assert set(res) >= {"ttft", "cotenant", "prefix", "meta", "criteria"}
    # the corpus is cut with the target's tokenizer: the server counts exactly the asked tokens
    assert [r["prompt_tokens"] for r in res["ttft"]] == [20, 90]
    for row in res["ttft"]:
        assert row["ok"] and row["ttft_ms"] > 0 and row["server_ttft_ms"] > 0
        assert [r["prompt_tokens"] for r in row["runs"]] == [row["prompt_tokens"]]
    c = res["cotenant"]
    assert c["long_prompt"]["code"] == "OK" and c["long_prompt"]["prompt_tokens"] == 200
    assert c["stream"]["code"] == "CANCELLED"  # cancelled by the bench once the long prompt's first token came
    assert c["stream_outlived_prefill"] and c["gap_ms_median"] > 0 and c["gap_ratio_max_over_median"] >= 1
    assert c["pass"] in (True, False)
    for part in ("chat", "system_prompt"):
        p = res["prefix"][part]
        assert p["first"]["code"] == p["second"]["code"] == "OK" and p["ratio"] > 0
        assert 0 <= p["second_cached_prompt_tokens"] <= p["second"]["prompt_tokens"]
        hr = p["prefix_cache"]["hit_rate"]
        assert hr is None or 0 <= hr <= 1
    chat = res["prefix"]["chat"]
    # turn 2 is turn 1 + its reply + a question: longer
    assert chat["second"]["prompt_tokens"] > chat["first"]["prompt_tokens"] + 8
    assert "| 90 |" in (out / "long_prompt.md").read_text()
    for png in ("ttft_vs_length.png", "cotenant_gaps.png", "prefix_reuse.png"):
        assert (out / png).stat().st_size > 1000, png


@pytest.mark.soak
def test_chat_soak_tiny(tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    soak = load_script("chat_soak")
    out = tmp_path / "soak"
    rc = soak.main(tiny_args(tiny_models, onnx_cache_dir, out) + [
        "--chats", "16", "--duration-s", "6", "--system-prompts", "3", "--system-prompt-tokens", "60",
        "--user-turn-tokens", "20", "--reply-tokens", "12", "--max-history-tokens", "300",
        "--sample-interval-s", "0.3", "--warmup-s", "2", "--warmup-kv-fill", "0"])
    rep = json.loads((out / "chat_soak.json").read_text())
    assert 2 <= rep["warmup_end_s"] < 4 and rep["warmup_end_why"] == "fixed --warmup-s"
    assert rep["load_seconds"] >= rep["warmup_end_s"] + 6  # the measured window follows the warm-up
    assert "--target-kv-budget-tokens 24576" in rep["args"]["up_args"]
    assert all(s["kv_budget_tokens"] == 24576 for s in rep["samples"] if s["kv_budget_tokens"] is not None)
    v = rep["verdicts"]
    assert set(v) == {"streams_complete", "no_active_session_lost", "kv_within_budget", "rss_growth"}
    assert rc == (1 if any(x["pass"] is False for x in v.values()) else 0)
    assert v["streams_complete"]["pass"], v["streams_complete"]
    assert v["no_active_session_lost"]["pass"], v["no_active_session_lost"]
    q = rep["requests"]
    assert q["total"] >= 16 and q["by_code"] == {"OK/LENGTH": q["total"]}
    assert {r["chat"] for r in rep["results"]} == set(range(16))
    assert q["max_turn"] >= 1  # replies were appended and the chats went on
    # the conversation grows turn by turn within a chat
    first = sorted((r for r in rep["results"] if r["chat"] == 0 and r["conversation"] == 0), key=lambda r: r["turn"])
    assert all(b["prompt_tokens"] > a["prompt_tokens"] + 12 for a, b in zip(first, first[1:]))
    assert set(rep["rss"]) == {"target", "draft", "orchestrator"}
    assert all(x["pass"] is not None and x["warmup_peak_mb"] > 0 for x in rep["rss"].values())
    assert all(x["anon_warmup_peak_mb"] > 0 and x["file_peak_after_mb"] > 0 for x in rep["rss"].values())
    assert rep["samples"] and all(s["active_sessions"] is not None for s in rep["samples"])
    assert (out / "chat_soak.png").stat().st_size > 1000
    assert (out / "chat_soak.md").read_text().startswith("# Chat soak: 16 chats")


def test_corpus_cuts_exact_lengths_and_variants_share_no_prefix(longctx: ModuleType) -> None:
    tok = build_tiny_tokenizer(longctx.TINY_CHARS)
    corpus = longctx.Corpus(tok, tiny=True)
    a, b = corpus.ids(700, 1), corpus.ids(700, 2)
    assert len(a) == len(b) == 700 and corpus.ids(700, 1) == a  # deterministic
    assert a[0] != b[0]  # a prefix cache cannot serve one variant from another
    assert corpus.ids(300, 1) == a[:300]
    assert set(corpus.text(200, 3)) <= set(longctx.TINY_CHARS)


def test_rss_growth_is_judged_on_levels_and_the_peaks_are_reported() -> None:
    """The level (median of the last window) at the warm-up's end against the
    run's end: a transient spike after the warm-up does not fail it, a
    steady climb does; a service with no warm-up sample is not judged."""
    soak = load_script("chat_soak")
    flat_spike = [(float(t), 100.0) for t in range(0, 20)] + [(20.0, 180.0)] + [(float(t), 101.0) for t in range(21, 40)]
    climb = [(float(t), 100.0 + (t - 10) * 0.5 if t > 10 else 100.0) for t in range(0, 40)]
    series = {"target": flat_spike, "draft": climb, "orchestrator": [(30.0, 50.0)]}
    rep = soak.rss_report(series, 0.0, 10.0, 0.05, window_s=5.0)
    t = rep["target"]
    assert t["warmup_level_mb"] == 100.0 and t["final_level_mb"] == 101.0 and t["pass"] is True
    assert t["peak_after_mb"] == 180.0 and t["peak_growth"] == 0.8  # reported, not judged
    d = rep["draft"]
    assert d["growth"] == round(d["final_level_mb"] / 100.0 - 1, 4) > 0.05 and d["pass"] is False
    assert rep["orchestrator"]["pass"] is None


def test_the_soak_warm_up_ends_when_the_kv_budget_is_full() -> None:
    """Warm-up ends one level window after the first sample past --warmup-s
    with KV >= the fill share of its budget (not before, however full), or
    at --warmup-max-s; the chats stop --duration-s after it."""
    import argparse
    import threading

    soak = load_script("chat_soak")

    def run(samples: list[tuple[float, float | None]], **kw: float) -> tuple[object, float | None]:
        s = object.__new__(soak.Soak)
        s.a = argparse.Namespace(**{"warmup_s": 10.0, "warmup_kv_fill": 0.9, "warmup_max_s": 100.0,
                                    "duration_s": 50.0, "level_window_s": 5.0, **kw})
        s.say, s.done, s.warm_end_s, s.warm_end_why, s.filled_at = (lambda msg: None), threading.Event(), None, "", None
        stopped = None
        for t, used in samples:
            s.control(t, {"kv_used_tokens": used, "kv_budget_tokens": 1000.0})
            if s.done.is_set() and stopped is None:
                stopped = t
        return s, stopped

    s, stop = run([(5, 950), (11, 800), (20, 899), (21, 900), (25, 700), (26, 700), (75, 10), (76, 10)])
    assert s.filled_at == 21 and s.warm_end_s == 26 and "90% of its budget at 21 s" in s.warm_end_why
    assert stop == 76
    s, stop = run([(5, 950), (50, None), (100, 100), (150, 100)])
    assert s.warm_end_s == 100 and "--warmup-max-s" in s.warm_end_why and stop == 150
    s, _ = run([(5, 0), (10, 0)], warmup_kv_fill=0.0)
    assert s.warm_end_s == 10 and s.warm_end_why == "fixed --warmup-s"
