"""`specdec bench` end to end on tiny models: it runs every configuration
through the real services and writes JSON, markdown and PNG plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specdec_app import bench, bench_report
from tests.stack import start_stack


def test_bench_writes_json_markdown_and_plots(tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(
            json.dumps({"id": "a", "category": "code-completion", "chat": False, "prompt": "def f(x):"}) + "\n"
            + json.dumps({"id": "b", "category": "prose", "chat": True, "prompt": "tell me a story"}) + "\n"
        )
        llamacpp = tmp_path / "llamacpp.json"  # scripts/bench_llamacpp.sh's format, two target-only rows
        llamacpp.write_text(json.dumps({"meta": {"llama_cpp_version": "test"}, "rows": [
            {"prompt": p, "category": c, "config": "target-only", "tok_s": 4.0, "decode_tok_s": 5.0}
            for p, c in (("a", "code-completion"), ("b", "prose"))]}))
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        out = tmp_path / "out"
        args = p.parse_args(["--address", stack.address, "--target-address", f"127.0.0.1:{stack.target.port}",
                             "--prompts", str(prompts), "--gammas", "1,3", "--policies", "auto,heuristic,auto-nostop",
                             "--max-new-tokens", "12", "--repeats", "2", "--out", str(out), "--llamacpp", str(llamacpp)])
        assert bench.main(args) == 0
        res = json.loads((out / "results.json").read_text())
        assert len(res["rows"]) == 2 * 5
        for row in res["rows"]:
            assert row["identical"], row  # float32 tiny target: greedy identical in every mode
            assert row["speedup"] > 0 and 0 <= row["acceptance_rate"] <= 1
            # decode-only throughput: the same tokens after the first, over the time after it
            assert row["spec_decode_tok_s"] > row["spec_tok_s"] * (row["tokens"] - 1) / row["tokens"]
            assert row["decode_speedup"] == row["spec_decode_tok_s"] / row["baseline_decode_tok_s"]
            assert 0 < row["spec_ttft_ms"] and 0 < row["baseline_ttft_ms"]
            assert row["leviathan_bound"] > 0
        assert sorted(int(k) for k in res["verify_cost_ms"]) == list(range(1, 9))
        # every result names its machine and the target's numerics
        assert res["meta"]["isa"] and res["meta"]["cpu"] and res["meta"]["target_dtype"] == "float32"
        assert res["meta"]["target_backend"] in ("eager", "packed")
        assert res["numerics"]["forward_cost_ms"] and res["numerics"]["calibrated"]
        md = (out / "results.md").read_text()
        assert "| code-completion |" in md and "auto" in md and "heuristic" in md
        for png in ("speedup.png", "speedup_vs_gamma.png", "gamma_trajectory_and_acceptance.png", "verify_cost.png",
                    "vs_llamacpp.png"):
            assert (out / png).stat().st_size > 1000, png
        auto = {r["prompt"]: r["spec_tok_s"] for r in res["rows"] if r["mode"] == "auto"}
        merged = json.loads((out / "vs_llamacpp.json").read_text())["rows"]
        assert {r["prompt"]: r["ratios"]["AUTO ÷ llama.cpp target-only"] for r in merged} == {
            k: v / 4.0 for k, v in auto.items()}
        assert "| b | prose |" in (out / "vs_llamacpp.md").read_text()
    finally:
        stack.close()


def test_repeats_interleave_configurations_and_keep_the_fastest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Repeats go round the configurations forwards, then backwards, so a slow
    spell of the machine lands on one run of each; the fastest run counts."""
    calls: list[tuple[str, int, str]] = []
    speed = iter([5.0, 1.0, 2.0, 9.0, 3.0, 4.0])

    def fake_generate(stub, prompt, mode, gamma, max_new, drafter):  # type: ignore[no-untyped-def]
        calls.append((mode, gamma, drafter))
        return {"tokens_per_second": next(speed), "run": len(calls)}

    monkeypatch.setattr(bench, "_generate", fake_generate)
    schedule = [("off", 0, ""), ("fixed", 2, "d"), ("auto", 0, "d")]
    best = bench._best_of_rounds(None, {"prompt": "x"}, schedule, 8, repeats=2)
    assert calls == schedule + schedule[::-1]
    assert best[("off", 0, "")]["run"] == 1  # 5.0 beats its second run's 4.0
    assert best[("fixed", 2, "d")]["run"] == 5  # 3.0 beats 1.0
    assert best[("auto", 0, "d")]["run"] == 4  # 9.0 beats 2.0


def test_paired_ratio_compares_runs_of_the_same_pass(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The paired ratio is the median over passes of the ratio within a pass
    (whose runs were neighbours); the ratio of the fastest runs can take
    them from different moments. Here OFF runs at 10, 5, 10 and AUTO at 6,
    12, 6 in the same three passes: within a pass AUTO is 0.6, 2.4 and 0.6
    of OFF (median 0.6), while the fastest runs say 1.2, AUTO's taken from
    the one pass where OFF was slow."""
    speeds = {("off", 0, ""): [10.0, 5.0, 10.0], ("auto", 0, "d"): [6.0, 12.0, 6.0]}
    it = {k: iter(v) for k, v in speeds.items()}

    def fake_generate(stub, prompt, mode, gamma, max_new, drafter):  # type: ignore[no-untyped-def]
        v = next(it[(mode, gamma, drafter)])
        return {"tokens_per_second": v, "decode_tokens_per_second": v}

    monkeypatch.setattr(bench, "_generate", fake_generate)
    schedule = [("off", 0, ""), ("auto", 0, "d")]
    passes: dict = {}  # type: ignore[type-arg]
    best = bench._best_of_rounds(None, {"prompt": "x"}, schedule, 8, repeats=3, passes=passes)
    assert [r["tokens_per_second"] for r in passes[("auto", 0, "d")]] == [6.0, 12.0, 6.0]
    paired = bench.paired_ratio(passes[("auto", 0, "d")], passes[("off", 0, "")], "decode_tokens_per_second")
    assert paired == pytest.approx(0.6)  # median of 0.6, 2.4, 0.6
    assert best[("auto", 0, "d")]["tokens_per_second"] / best[("off", 0, "")]["tokens_per_second"] == pytest.approx(1.2)
    # another field name on the other side (llama.cpp's runs say decode_tok_s), and no pass in common
    assert bench.paired_ratio([{"a": 3.0}], [{"b": 2.0}], "a", "b") == pytest.approx(1.5)
    assert bench.paired_ratio([], [{"b": 2.0}], "a", "b") is None


def test_speedup_against_the_fastest_target_only_configuration() -> None:
    res = {"numerics": {"dtype": "float32", "backend": "packed"},
           "rows": [{"prompt": "a", "spec_tok_s": 8.0, "baseline_tok_s": 2.5},
                    {"prompt": "b", "spec_tok_s": 3.0, "baseline_tok_s": 2.5}]}
    bench.add_fastest_baseline(res, {"bfloat16/eager": {"a": 4.0, "b": 2.0}, "float32/eager": {"a": 2.0, "b": 1.0}})
    a, b = res["rows"]
    assert (a["fastest_off"], a["fastest_off_tok_s"], a["speedup_vs_fastest_off"]) == ("bfloat16/eager", 4.0, 2.0)
    assert (b["fastest_off"], b["speedup_vs_fastest_off"]) == ("float32/packed", 3.0 / 2.5)
    for r in res["rows"]:
        r.update(drafter="d", mode="auto", gamma=0)
    md = "\n".join(bench_report.fastest_table(res["rows"]))
    assert "| a | d | auto | adaptive | 8.00 | 2.50 | bfloat16/eager | 4.00 | 2.00× |" in md


def test_target_only_baselines_skip_pairs_that_cannot_be_the_fastest() -> None:
    numerics = {"dtype": "bfloat16", "backend": "bf16w", "calibrated": {
        "bfloat16/bf16w": {"forward_cost_ms": {1: 281.0}}, "bfloat16/eager": {"forward_cost_ms": {1: 279.0}},
        "float32/packed": {"forward_cost_ms": {1: 528.0}}, "float32/eager": {"forward_cost_ms": {1: 602.0}}}}
    keep, skipped = bench.baseline_pairs(numerics, "near")
    assert keep == ["bfloat16/eager"] and sorted(skipped) == ["float32/eager", "float32/packed"]
    assert bench.baseline_pairs(numerics, "all")[0] == ["bfloat16/eager", "float32/packed", "float32/eager"]
    assert bench.baseline_pairs(numerics, "float32/eager")[0] == ["float32/eager"]


STUB_SERVER = '''#!{python}
"""A stand-in for llama.cpp's llama-server (not built in CI): /health, and a
streamed /completion that answers a prompt of ids with its last id repeated,
logging every request's ids."""
import http.server, json, sys
args = sys.argv[1:]
if "--version" in args:
    print("version: 0 (stub)", file=sys.stderr)
    sys.exit(0)
port = int(args[args.index("--port") + 1])
LOG = {log!r}

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(LOG, "a") as f:
            f.write(json.dumps(body["prompt"]) + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = min(3, body["n_predict"])
        for i in range(n):
            ev = {{"content": "x", "tokens": [body["prompt"][-1]], "stop": False}}
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\\n\\n")
        end = {{"content": "", "tokens": [], "stop": True, "stop_type": "limit", "timings": {{"predicted_n": n}}}}
        self.wfile.write(b"data: " + json.dumps(end).encode() + b"\\n\\n")

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_bench_runs_llamacpp_interleaved_on_the_same_prompt_ids(tiny_models, onnx_cache_dir: Path,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    """--llamacpp-bin: llama-server (a stub here) is one more configuration of
    every prompt, sent the prompt's ids as the orchestrator renders them, its
    fastest run kept, written as llamacpp.json and compared in vs_llamacpp.*"""
    import sys

    from transformers import AutoTokenizer

    stack = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    try:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        log = tmp_path / "requests.jsonl"
        stub = bin_dir / "llama-server"
        stub.write_text(STUB_SERVER.format(python=sys.executable, log=str(log)))
        stub.chmod(0o755)
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(
            json.dumps({"id": "a", "category": "code-completion", "chat": False, "prompt": "def f(x):"}) + "\n"
            + json.dumps({"id": "b", "category": "prose", "chat": True, "prompt": "tell me a story"}) + "\n"
        )
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        out = tmp_path / "out"
        args = p.parse_args(["--address", stack.address, "--target-address", f"127.0.0.1:{stack.target.port}",
                             "--prompts", str(prompts), "--gammas", "", "--policies", "auto", "--no-cost-curve",
                             "--max-new-tokens", "8", "--repeats", "2", "--out", str(out),
                             "--llamacpp-bin", str(bin_dir), "--llamacpp-model", str(tmp_path / "target.gguf"),
                             "--target-model", str(tiny_models.target)])
        assert bench.main(args) == 0
        tok = AutoTokenizer.from_pretrained(str(tiny_models.target))
        chat = tok.apply_chat_template([{"role": "user", "content": "tell me a story"}], add_generation_prompt=True,
                                       tokenize=False)
        want = {"a": tok("def f(x):")["input_ids"], "b": tok(chat, add_special_tokens=False)["input_ids"]}
        sent = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(sent) == 1 + 2 * 2  # a warm-up, then every prompt's repeats
        assert sent[1:3] == [want["a"]] * 2 and sent[3:] == [want["b"]] * 2
        llama = json.loads((out / "llamacpp.json").read_text())
        assert llama["meta"]["interleaved"] and llama["meta"]["llama_cpp_version"] == "0 (stub)"
        assert {r["prompt"]: r["token_ids"] for r in llama["rows"]} == {k: [v[-1]] * 3 for k, v in want.items()}
        res = json.loads((out / "results.json").read_text())
        off = {r["prompt"]: r for r in res["rows"]}
        for r in llama["rows"]:  # compared with specdec OFF's ids (the tiny target does not repeat one id)
            assert r["identical_to_specdec_off"] is False
        merged = {r["prompt"]: r for r in json.loads((out / "vs_llamacpp.json").read_text())["rows"]}
        tok_s = {r["prompt"]: r["tok_s"] for r in llama["rows"]}
        for pid, r in merged.items():
            assert r["tok_s"]["llama.cpp target-only"] == tok_s[pid]
            assert r["ratios"]["AUTO ÷ llama.cpp target-only"] == off[pid]["spec_tok_s"] / tok_s[pid]
        assert "interleaved with specdec prompt by prompt" in (out / "vs_llamacpp.md").read_text()
        # a bin directory without llama-server: a clear message before anything starts
        empty = tmp_path / "empty-bin"
        empty.mkdir()
        bad = p.parse_args(["--address", stack.address, "--out", str(tmp_path / "bad"), "--llamacpp-bin", str(empty),
                            "--llamacpp-model", str(tmp_path / "target.gguf"), "--target-model", str(tiny_models.target)])
        with pytest.raises(SystemExit, match="no executable llama-server in"):
            bench.main(bad)
    finally:
        stack.close()


def test_only_takes_comma_separated_ids_and_refuses_unknown_ones(tmp_path: Path) -> None:
    """`--only a,c` and `--only a --only c` pick the same prompts; an id the
    prompt file lacks stops the bench with the known ids, not an empty table."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": "prose", "chat": True, "prompt": i}) + "\n"
                               for i in ("a", "b", "c")))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)

    def ids(*only: str) -> list[str]:
        argv = ["--prompts", str(prompts)] + [x for o in only for x in ("--only", o)]
        return [q["id"] for q in bench.select_prompts(p.parse_args(argv))]

    assert ids() == ["a", "b", "c"]
    assert ids("a,c") == ids("a", "c") == ids(" c , a") == ["a", "c"]
    with pytest.raises(SystemExit, match=r"--only x, y: not in .*\(a, b, c\)"):
        ids("a,x", "y")
