"""specdec bench results merged with llama.cpp's (specdec_app/bench_compare):
per-prompt columns, ratios to llama.cpp target-only and category geometric
means, on small synthetic results in the two scripts' formats."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from specdec_app import bench_compare


def spec_row(prompt: str, category: str, mode: str, gamma: int, off: float, spec: float, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "category": category, "mode": mode, "gamma": gamma, "drafter": "model",
            "baseline_tok_s": off, "baseline_decode_tok_s": off * 1.5, "spec_tok_s": spec,
            "spec_decode_tok_s": spec * 1.5, **extra}


def llama_row(prompt: str, category: str, config: str, tok_s: float) -> dict[str, Any]:
    return {"prompt": prompt, "category": category, "config": config, "tok_s": tok_s, "decode_tok_s": tok_s * 2}


SPEC = {"meta": {"date": "2026-12-02 10:00", "cpu": "test cpu", "target_dtype": "bfloat16", "target_backend": "bf16w",
                 "max_new_tokens": 128},
        "rows": [spec_row("py", "code-completion", "fixed", 4, 10.0, 99.0),  # a fixed γ: not the AUTO column
                 spec_row("py", "code-completion", "auto", 0, 10.0, 20.0),
                 spec_row("js", "code-completion", "auto", 0, 12.0, 18.0),
                 spec_row("prose", "prose", "auto", 0, 14.0, 13.0),
                 spec_row("no-llama", "prose", "auto", 0, 1.0, 1.0)]}
LLAMA = {"meta": {"llama_cpp_version": "11434.0.0", "date": "2026-12-02 11:00", "threads": 2, "max_new_tokens": 128},
         "rows": [llama_row(p, c, cfg, v) for p, c, cfg, v in (
             ("py", "code-completion", "target-only", 16.0), ("py", "code-completion", "server spec n_max=4", 8.0),
             ("js", "code-completion", "target-only", 9.0), ("js", "code-completion", "server spec n_max=4", 6.0),
             ("prose", "prose", "target-only", 26.0), ("prose", "prose", "server spec n_max=4", 13.0),
             ("only-llama", "prose", "target-only", 30.0))]}


def test_each_prompt_in_both_gets_specdec_and_llamacpp_columns_and_the_ratio() -> None:
    rows = bench_compare.merge(SPEC, LLAMA)
    assert [r["prompt"] for r in rows] == ["py", "js", "prose"]  # only prompts both measured, in specdec's order
    py = rows[0]
    assert py["tok_s"] == {"specdec OFF": 10.0, "specdec AUTO": 20.0, "llama.cpp target-only": 16.0,
                           "llama.cpp server spec n_max=4": 8.0}
    assert py["decode_tok_s"]["specdec AUTO"] == 30.0 and py["decode_tok_s"]["llama.cpp target-only"] == 32.0
    assert py["ratios"] == {"OFF ÷ llama.cpp target-only": 10.0 / 16.0, "AUTO ÷ llama.cpp target-only": 20.0 / 16.0}
    assert rows[1]["ratios"]["AUTO ÷ llama.cpp target-only"] == 2.0


def test_category_means_are_geometric() -> None:
    means = bench_compare.category_means(bench_compare.merge(SPEC, LLAMA), "ratios")
    assert means["code-completion"]["AUTO ÷ llama.cpp target-only"] == pytest.approx(math.sqrt(1.25 * 2.0))
    assert means["prose"]["AUTO ÷ llama.cpp target-only"] == pytest.approx(0.5)
    tok = bench_compare.category_means(bench_compare.merge(SPEC, LLAMA), "tok_s")
    assert tok["code-completion"]["llama.cpp target-only"] == pytest.approx(12.0)  # sqrt(16 * 9)


def test_the_fastest_off_is_the_baseline_of_the_off_ratio_when_measured() -> None:
    spec = {"rows": [spec_row("py", "code-completion", "auto", 0, 10.0, 20.0, fastest_off_tok_s=12.0)]}
    row = bench_compare.merge(spec, LLAMA)[0]
    assert row["tok_s"]["specdec fastest OFF"] == 12.0 and "specdec fastest OFF" not in row["decode_tok_s"]
    assert row["ratios"] == {"fastest OFF ÷ llama.cpp target-only": 0.75, "AUTO ÷ llama.cpp target-only": 1.25}


def test_several_drafters_get_one_auto_column_each() -> None:
    spec = {"rows": [spec_row("py", "code-completion", "auto", 0, 10.0, 20.0),
                     {**spec_row("py", "code-completion", "auto", 0, 10.0, 32.0), "drafter": "lookup"}]}
    row = bench_compare.merge(spec, LLAMA)[0]
    assert row["ratios"]["AUTO (model) ÷ llama.cpp target-only"] == 1.25
    assert row["ratios"]["AUTO (lookup) ÷ llama.cpp target-only"] == 2.0


def test_the_command_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps(SPEC))
    (tmp_path / "llamacpp.json").write_text(json.dumps(LLAMA))
    out = tmp_path / "report"
    assert bench_compare.main([str(tmp_path / "results.json"), str(tmp_path / "llamacpp.json"), "--out", str(out)]) == 0
    md = (out / "vs_llamacpp.md").read_text()
    assert "| prompt | category | specdec OFF | specdec AUTO | llama.cpp target-only | llama.cpp server spec n_max=4 |" in md
    assert "| py | code-completion | 10.00 | 20.00 | 16.00 | 8.00 |" in md
    assert "| prompt | category | OFF ÷ llama.cpp target-only | AUTO ÷ llama.cpp target-only |" in md
    assert "| code-completion | 0.91 | 1.58 |" in md  # sqrt(10/16 * 12/9), sqrt(1.25 * 2)
    assert "11434.0.0" in md and "bf16w" in md and "not comparable" not in md
    other = bench_compare.to_markdown([], SPEC["meta"], {**LLAMA["meta"], "max_new_tokens": 8})
    assert "different token counts: not comparable" in other
    res = json.loads((out / "vs_llamacpp.json").read_text())
    assert res["by_category"]["ratios"]["prose"]["AUTO ÷ llama.cpp target-only"] == pytest.approx(0.5)
    assert (out / "vs_llamacpp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paired_ratios_get_their_own_table_and_category_means(tmp_path: Path) -> None:
    """A run interleaved with llama.cpp carries each row's decode ratios
    paired by pass; they are reported as such, apart from the ratios of the
    fastest runs, and a row without them (an older run) has no such column."""
    spec = {**SPEC, "rows": [spec_row("py", "code-completion", "auto", 0, 10.0, 20.0,
                                      off_vs_llamacpp_paired=0.8, spec_vs_llamacpp_paired=1.1),
                             spec_row("js", "code-completion", "auto", 0, 12.0, 18.0,
                                      off_vs_llamacpp_paired=0.9, spec_vs_llamacpp_paired=1.6),
                             spec_row("prose", "prose", "auto", 0, 14.0, 13.0)]}
    rows = bench_compare.merge(spec, LLAMA)
    assert rows[0]["paired"] == {"OFF ÷ llama.cpp target-only": 0.8, "AUTO ÷ llama.cpp target-only": 1.1}
    assert "paired" not in rows[2]
    bench_compare.write(spec, LLAMA, tmp_path)
    res = json.loads((tmp_path / "vs_llamacpp.json").read_text())
    cat = res["by_category"]["paired"]
    assert list(cat) == ["code-completion"]
    assert cat["code-completion"]["AUTO ÷ llama.cpp target-only"] == pytest.approx(math.sqrt(1.1 * 1.6))
    md = (tmp_path / "vs_llamacpp.md").read_text()
    assert "paired by pass" in md and "| code-completion | 0.85 | 1.33 |" in md
