"""Target compute backends and start-up calibration (issue: a target that
measures its own hardware). Real tiny Qwen2 models, no gRPC except where the
service contract is the point.

- the packed backend's logits match eager float32 within 1e-4 with the same
  argmax, for prefill, single steps, verify passes and batched forwards;
- the choice rule keeps the faster pair and explicit flags always win;
- calibration runs on a real model, is cached per machine and model, and a
  backend that measures slower is not chosen.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from specdec.sampling import SamplingConfig
from target_service import calibration as cal
from target_service.backends import PackedLinear, cpu_info, eligible_pairs, packed_supported
from target_service.calls import PrefillCall, VerifyCall
from target_service.engine import TargetEngine
from target_service.loading import load_model, measure_forward_curve

# float32 GEMMs in another blocking order: observed max |Δlogit| ≈ 2e-6 on the
# tiny model (and 5e-5 on the 1.5B target, docs/benchmarks.md)
LOGIT_TOL = 1e-4

needs_packed = pytest.mark.skipif(
    not packed_supported(torch.float32, torch.device("cpu")), reason="oneDNN not available in this torch build"
)


@pytest.fixture(scope="module")
def engines(tiny_models):  # type: ignore[no-untyped-def]
    eager = TargetEngine(tiny_models.target, dtype="float32", backend="eager", max_sessions=16, kv_budget_tokens=4096)
    packed = TargetEngine(tiny_models.target, dtype="float32", backend="packed", max_sessions=16, kv_budget_tokens=4096)
    return eager, packed


@needs_packed
def test_packed_backend_replaces_every_linear(engines) -> None:  # type: ignore[no-untyped-def]
    _, packed = engines
    mods = list(packed.model.modules())
    assert not any(type(m) is torch.nn.Linear for m in mods)
    # q/k/v/o, gate/up/down per layer, plus the LM head
    layers = packed.model.config.num_hidden_layers
    assert sum(isinstance(m, PackedLinear) for m in mods) == 7 * layers + 1
    assert packed.vocab_size == engines[0].vocab_size


@needs_packed
def test_packed_logits_match_eager_float32(engines) -> None:  # type: ignore[no-untyped-def]
    eager, packed = engines
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 5, 17, 40):
        ids = torch.randint(1, eager.vocab_size, (n,), generator=g).tolist()
        ce, cp = DynamicCache(config=eager.model.config), DynamicCache(config=packed.model.config)
        le, lp = eager._forward(ce, ids, n), packed._forward(cp, ids, n)
        assert (le - lp).abs().max().item() < LOGIT_TOL
        assert torch.equal(le.argmax(-1), lp.argmax(-1))
        # then a 1-token step and a 6-token verify pass on the caches
        for k in (1, 6):
            more = torch.randint(1, eager.vocab_size, (k,), generator=g).tolist()
            le, lp = eager._forward(ce, more, k), packed._forward(cp, more, k)
            assert (le - lp).abs().max().item() < LOGIT_TOL
            assert torch.equal(le.argmax(-1), lp.argmax(-1))


@needs_packed
def test_packed_batched_verify_equals_eager_unbatched(engines) -> None:  # type: ignore[no-untyped-def]
    """Several sessions in one packed forward: same accepted counts and next
    tokens as eager float32 serving each alone."""
    eager, packed = engines
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    greedy = SamplingConfig()
    pre_e = [eager.prefill(p, greedy, True) for p in prompts]
    pre_p = [o for o, _ in packed.run_batch([PrefillCall(p, greedy, True) for p in prompts])]
    assert [o.next_token for o in pre_e] == [o.next_token for o in pre_p]  # type: ignore[union-attr]
    drafts = [[5, 6, 7], [1], [2, 3, 4, 5, 6]]
    out_e = [eager.verify(o.session_id, o.cache_len, [o.next_token], d, [None] * len(d)) for o, d in zip(pre_e, drafts)]
    out_p = packed.run_batch([
        VerifyCall(o.session_id, o.cache_len, [o.next_token], d, [None] * len(d))  # type: ignore[union-attr]
        for o, d in zip(pre_p, drafts)
    ])
    assert all(info.batch_size == 3 for _, info in out_p)
    for e, (p, _) in zip(out_e, out_p):
        assert (e.result.num_accepted, e.result.next_token, e.cache_len) == (
            p.result.num_accepted, p.result.next_token, p.cache_len)  # type: ignore[union-attr]


# ----------------------------------------------------------------- choice
FAST_STEP = {1: 240.0, 2: 404.0, 4: 807.0, 8: 1434.0, 16: 2676.0}  # bf16 eager, AVX2 (issue table)
FLAT = {1: 381.0, 2: 411.0, 4: 476.0, 8: 553.0, 16: 745.0}  # float32 packed, AVX2


def test_choice_keeps_the_faster_of_two_otherwise_equal_curves() -> None:
    slow = {k: 1.3 * v for k, v in FLAT.items()}
    choice = cal.pick_pair({("float32", "eager"): slow, ("float32", "packed"): FLAT})
    assert choice.pair == ("float32", "packed")
    choice = cal.pick_pair({("float32", "packed"): slow, ("float32", "eager"): FLAT})
    assert choice.pair == ("float32", "eager")


def test_choice_weighs_a_flat_verify_curve_against_a_fast_single_step() -> None:
    """The AVX2 trade-off: bf16 eager has the fastest step, float32 packed
    the flattest curve. At low acceptance the fast step wins, at high
    acceptance the flat curve; over the stated mix the flat curve wins, and
    a curve as flat but 2x slower at every k loses to the fast step."""
    draft = 0.1 * 240.0
    assert cal.best_rate(FAST_STEP, 0.1, draft)[0] > cal.best_rate(FLAT, 0.1, draft)[0]
    assert cal.best_rate(FLAT, 0.9, draft)[0] > 1.5 * cal.best_rate(FAST_STEP, 0.9, draft)[0]
    assert cal.best_rate(FLAT, 0.1, draft)[1] == 0  # low acceptance: plain decoding (γ = 0)
    curves = {("bfloat16", "eager"): FAST_STEP, ("float32", "packed"): FLAT}
    assert cal.pick_pair(curves).pair == ("float32", "packed")
    slow_flat = {k: 2 * v for k, v in FLAT.items()}
    assert cal.pick_pair({("bfloat16", "eager"): FAST_STEP, ("float32", "packed"): slow_flat}).pair == ("bfloat16", "eager")


def test_interpolation_follows_a_curve_that_is_not_a_line() -> None:
    c = {1: 100.0, 2: 300.0, 4: 310.0, 8: 330.0}
    assert cal.interpolate(c, 1) == 100.0
    assert cal.interpolate(c, 3) == pytest.approx(305.0)
    assert cal.interpolate(c, 16) == pytest.approx(330.0 + 5.0 * 8)
    assert cal.interpolate(c, 0) == 100.0


def test_explicit_flags_win_and_impossible_pairs_are_refused() -> None:
    cpu = torch.device("cpu")
    assert cal.resolve_pairs("bfloat16", "eager", cpu) == ([("bfloat16", "eager")], "flags")
    pairs, how = cal.resolve_pairs("float32", "auto", cpu)
    assert all(p[0] == "float32" for p in pairs) and how in ("calibration", "flags")
    pairs, how = cal.resolve_pairs("auto", "auto", cpu)
    assert pairs == eligible_pairs(cpu) and how == "calibration"
    assert ("float32", "eager") in pairs and ("bfloat16", "eager") in pairs
    if not cpu_info().mkldnn_bf16:
        assert ("bfloat16", "packed") not in pairs
        with pytest.raises(ValueError, match="packed cannot run bfloat16"):
            cal.resolve_pairs("bfloat16", "packed", cpu)
    with pytest.raises(ValueError, match="unknown target backend"):
        cal.resolve_pairs("auto", "turbo", cpu)
    with pytest.raises(ValueError, match="unknown target dtype"):
        cal.resolve_pairs("int3", "auto", cpu)


# ------------------------------------------------------------ calibration
def test_measured_curve_is_a_real_timing_of_the_model(tiny_models) -> None:  # type: ignore[no-untyped-def]
    model = load_model(tiny_models.target, torch.float32, "eager", torch.device("cpu"))
    calls = []
    real = model.forward

    def slow_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs["input_ids"].shape[1])
        time.sleep(0.004 * kwargs["input_ids"].shape[1])  # 4 ms per token on top of the model
        return real(*args, **kwargs)

    model.forward = slow_forward  # type: ignore[method-assign]
    curve = measure_forward_curve(model, torch.device("cpu"), (1, 4, 8), kv_tokens=16)
    assert sorted(curve) == [1, 4, 8]
    assert curve[1] >= 4.0 and curve[4] >= 16.0 and curve[8] >= 32.0
    assert curve[8] > curve[4] > curve[1]
    assert calls[0] == 16  # the KV prefix, then k-token passes on top of it
    assert set(calls[1:]) == {1, 4, 8}


def test_a_slow_spell_of_the_machine_does_not_bend_the_calibrated_curve(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """t(k) is timed in rounds over every k, so a slow spell (here six
    passes in a row at 4x the time, on a fake clock) slows every k alike and
    each k's median is its true time: the curve's shape, which prices a span
    before any is seen, is the machine's. Negative control: the same spell
    timed k after k (the old order) lands on k = 1 and 2 only and bends it."""
    clock, passes = [0.0], [0]

    def forward(k: int) -> None:
        passes[0] += 1
        slow = 4.0 if 8 <= passes[0] < 14 else 1.0  # after the 5 untimed passes: the 3rd to the 8th timed
        clock[0] += (0.010 + 0.002 * k) * slow

    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    ks = (1, 2, 4, 8, 16)
    curve = cal.measure_curve(forward, lambda: None, ks, reps=5, budget_s=30.0)
    assert curve == {k: pytest.approx(10.0 + 2.0 * k) for k in ks}
    assert passes[0] == 5 + 5 * len(ks)

    passes[0] = 0  # the control: the spell at the same passes, timed k after k
    for k in ks:
        forward(k)
    bent = {}
    for k in ks:
        times = []
        for _ in range(5):
            t0 = clock[0]
            forward(k)
            times.append((clock[0] - t0) * 1000.0)
        bent[k] = sorted(times)[2]
    assert bent[1] == pytest.approx(4 * 12.0) and bent[2] == pytest.approx(4 * 14.0)  # in the spell: the median too
    assert bent[4] == pytest.approx(18.0)  # t(4) < t(1): the shape is the spell's, not the machine's


def test_calibration_stops_starting_rounds_once_its_budget_is_spent(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A slow pair gets fewer rounds, one at least, every k timed in each."""
    clock, timed = [0.0], []

    def forward(k: int) -> None:
        timed.append(k)
        clock[0] += 1.0 * k  # a second per token: a round of (1, 2, 4) takes 7 s

    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    curve = cal.measure_curve(forward, lambda: None, (1, 2, 4), reps=5, budget_s=10.0)
    assert curve == {1: 1000.0, 2: 2000.0, 4: 4000.0}
    assert timed[3:] == [1, 2, 4, 1, 2, 4]  # warm-ups, round 1 (7 s), round 2 (started at 7 s < 10 s), no third
    timed.clear()
    cal.measure_curve(forward, lambda: None, (1, 2, 4), reps=5, budget_s=0.0)
    assert timed[3:] == [1, 2, 4]  # one round at least


def test_a_backend_that_measures_slower_is_not_chosen_and_results_are_cached(tiny_models, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    measured: list[tuple[str, str]] = []

    def measure(pair: tuple[str, str]) -> tuple[dict[int, float], None]:
        measured.append(pair)
        model = load_model(tiny_models.target, getattr(torch, pair[0]), "eager", torch.device("cpu"))
        curve = measure_forward_curve(model, torch.device("cpu"), cal.CALIBRATION_KS, kv_tokens=16)
        if pair == ("float32", "eager"):
            # this one measured slower: a second added to every real timing, so
            # a loaded machine's noise (tiny passes here vary by 100s of ms
            # under load) cannot change which one is slower
            curve = {k: ms + 1000.0 for k, ms in curve.items()}
        return curve, None

    pairs = [("float32", "eager"), ("bfloat16", "eager")]
    cache = cal.CalibrationCache(tmp_path, {"cpu": "test", "model": "tiny"})
    res = cal.choose(pairs, measure, cache)
    assert (res.dtype, res.backend) == ("bfloat16", "eager")
    assert res.curves["float32/eager"][1] > res.curves["bfloat16/eager"][1] + 500.0
    assert res.scores["bfloat16/eager"] > res.scores["float32/eager"]
    assert measured == pairs and not res.cached
    again = cal.choose(pairs, measure, cal.CalibrationCache(tmp_path, {"cpu": "test", "model": "tiny"}))
    assert measured == pairs  # nothing re-measured
    assert again.cached and (again.dtype, again.backend) == ("bfloat16", "eager")
    assert again.curves == res.curves
    # another machine (or model) measures again
    cal.choose(pairs, measure, cal.CalibrationCache(tmp_path, {"cpu": "other", "model": "tiny"}))
    assert measured == pairs * 2


def test_calibrate_hands_over_the_measured_model_and_logs_the_table(tiny_models, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("INFO", logger="specdec.target")
    res, model = cal.calibrate(tiny_models.target, "float32", "auto", torch.device("cpu"), tmp_path, "tiny")
    assert res.chosen_by in ("calibration", "flags")
    assert res.dtype == "float32" and res.backend in ("eager", "packed")
    assert set(res.curve) == set(cal.CALIBRATION_KS)
    assert any("target numerics chosen" in r.getMessage() for r in caplog.records)
    if model is not None:  # the last measured pair was the chosen one: no reload
        assert isinstance(model, torch.nn.Module)
    res2, _ = cal.calibrate(tiny_models.target, "float32", "auto", torch.device("cpu"), tmp_path, "tiny")
    assert res2.cached and (res2.dtype, res2.backend) == (res.dtype, res.backend)
    # explicit pair, no timing: nothing measured, the flags are the choice
    res3, model3 = cal.calibrate(tiny_models.target, "float32", "eager", torch.device("cpu"), None, "tiny", measure=False)
    assert (res3.dtype, res3.backend, res3.chosen_by, res3.curve, model3) == ("float32", "eager", "flags", {}, None)


# ------------------------------------------------------------------ bf16w
needs_bf16w = pytest.mark.skipif(
    not __import__("target_service.bf16w", fromlist=["available"]).available()[0],
    reason="bf16w kernel unavailable (needs x86-64 with AVX2+FMA and a C compiler)",
)


@needs_bf16w
@pytest.mark.parametrize("n, k", [(37, 61), (8, 8), (129, 1536), (4, 3)])
def test_bf16w_kernel_is_float32_math_on_bf16_weights(n: int, k: int) -> None:
    """Against float64 math on the same bf16-rounded weights; odd shapes
    exercise the scalar tail (K % 8) and partial row blocks (N % 4)."""
    from target_service import bf16w

    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 7, 16, 65):  # 2 x 65 = 130 rows: the blocked (prompt) path
        x = torch.randn(2, m, k, generator=g)
        y = bf16w.linear(x, w, b)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        assert y.shape == (2, m, n) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max().item() < 1e-5 * (1 + k ** 0.5) * 4
        assert bf16w.linear(x, w, None).sub(y - b).abs().max().item() < 1e-5 * k ** 0.5


@needs_bf16w
def test_bf16w_outputs_do_not_depend_on_the_rows_beside_them() -> None:
    """A row's output is bit-identical whether it is computed alone (a
    1-token step), among k rows (a verify pass) or in a batch, and whatever
    the thread split: verify and plain decoding round the same way."""
    from target_service import bf16w

    g = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 1536, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 9, 1536, generator=g)
    full = bf16w.linear(x, w, None)
    for i in range(3):
        for j in (0, 4, 8):
            assert torch.equal(bf16w.linear(x[i, j : j + 1], w, None)[0], full[i, j])
    assert torch.equal(bf16w.linear(x[:, 2:6], w, None), full[:, 2:6])
    # every pass width a verify or a batch uses (the kernel groups rows by up
    # to six, so 7..16 split into groups), prompt widths that take the
    # blocked path (from 128 rows: float32 panels, K in chunks of 512 with the
    # lanes carried between chunks), and a K with a scalar tail that is
    # longer than one chunk (1541 = 3 x 512 + 5: the last chunk is tail only)
    w2 = torch.randn(133, 1541, generator=g).to(torch.bfloat16)
    b2 = torch.randn(133, generator=g)
    x2 = torch.randn(140, 1541, generator=g)
    alone = torch.stack([bf16w.linear(x2[i : i + 1], w2, b2)[0] for i in range(140)])
    for m in [*range(1, 17), 127, 128, 133, 140]:
        assert torch.equal(bf16w.linear(x2[:m], w2, b2), alone[:m]), m
    try:
        bf16w.set_threads(1)
        assert torch.equal(bf16w.linear(x, w, None), full)
    finally:
        bf16w.set_threads(0)
    # negative control: the same row under float32 eager matmul in a batch of
    # 9 vs alone is allowed to differ; here it must not (bitwise), so a kernel
    # that blocked rows differently would fail the assertions above


@needs_bf16w
def test_bf16w_engine_greedy_speculation_equals_step_by_step(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Greedy identity on the bf16w engine: a 70-token prompt, then 24 tokens
    decoded one step at a time, and the same 24 verified in spans of 5 drafted
    tokens with a wrong token in some spans; the committed tokens are the
    same."""
    eng = TargetEngine(tiny_models.target, dtype="bfloat16", backend="bf16w", max_sessions=4, kv_budget_tokens=4096)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, eng.vocab_size, (70,), generator=g).tolist()
    greedy = SamplingConfig()
    pre = eng.prefill(prompt, greedy, True)
    steps, nxt, cl = [], pre.next_token, pre.cache_len
    while len(steps) < 24:
        steps.append(nxt)
        out = eng.verify(pre.session_id, cl, [nxt], [], [])
        nxt, cl = out.result.next_token, out.cache_len
    pre2 = eng.prefill(prompt, greedy, True)
    assert pre2.next_token == pre.next_token
    spec, nxt, cl, rnd = [], pre2.next_token, pre2.cache_len, 0
    while len(spec) < 24:
        spec.append(nxt)
        want = steps[len(spec) : len(spec) + 5]
        draft = [(t + 1) % eng.vocab_size if rnd % 3 == 1 and i == 2 else t for i, t in enumerate(want)]
        out = eng.verify(pre2.session_id, cl, [nxt], draft, [None] * len(draft))
        spec += draft[: out.result.num_accepted]
        nxt, cl, rnd = out.result.next_token, out.cache_len, rnd + 1
    assert spec[:24] == steps


@needs_bf16w
def test_bf16w_model_matches_float32_with_bf16_rounded_weights(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from target_service.backends import compute_threads

    cpu = torch.device("cpu")
    threads = compute_threads()
    fast = load_model(tiny_models.target, torch.bfloat16, "bf16w", cpu)
    assert torch.get_num_threads() == 1  # torch ops single-threaded under bf16w (the kernel has the cores)
    ref = load_model(tiny_models.target, torch.float32, "eager", cpu)
    assert torch.get_num_threads() == threads  # other backends give torch the cores back
    with torch.no_grad():  # every weight bf16-rounded, computed in float32
        for prm in ref.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    ids = torch.randint(1, 34, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = fast(input_ids=ids, use_cache=False).logits.float()
        b = ref(input_ids=ids, use_cache=False).logits.float()
    assert (a - b).abs().max().item() < LOGIT_TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_bf16w_refuses_what_it_cannot_run() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="bf16w"):
        cal.resolve_pairs("float32", "bf16w", cpu)


def test_calibration_skips_pairs_that_would_not_fit_in_memory(tiny_models, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A container whose memory limit holds the bf16 model but not the
    float32 one calibrates (and runs) only bf16 pairs instead of being
    killed for memory; nothing fits: a clear error."""
    size = cal.checkpoint_bytes(tiny_models.target)  # float32 on disk
    assert size > 0
    monkeypatch.setattr(cal, "available_memory_bytes", lambda: int(size * 0.8))
    res, _ = cal.calibrate(tiny_models.target, "auto", "auto", torch.device("cpu"), tmp_path, "tiny")
    assert res.dtype == "bfloat16" and all(k.startswith("bfloat16/") for k in res.curves)
    monkeypatch.setattr(cal, "available_memory_bytes", lambda: int(size * 0.1))
    with pytest.raises(ValueError, match="no dtype fits"):
        cal.calibrate(tiny_models.target, "auto", "auto", torch.device("cpu"), tmp_path, "tiny")


def test_cli_refuses_a_pair_this_machine_cannot_run_with_one_line() -> None:
    from specdec_app.cli import build_parser
    from target_service.cli import config_from_args as target_config

    a = build_parser().parse_args(["serve", "target", "--dtype", "float32", "--backend", "bf16w"])
    with pytest.raises(SystemExit, match="specdec: --target-backend bf16w cannot run float32"):
        target_config(a, 0)


@needs_bf16w
def test_bf16w_bench_script_compares_two_kernels(tmp_path: Path) -> None:
    """scripts/bf16w_bench.py runs (one repetition, a step and a prompt-sized
    M) against the committed kernel and checks their outputs are equal."""
    import json
    import shutil
    import subprocess
    import sys

    from tests.stack import REPO

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the script reads the other kernel from git)")
    out = tmp_path / "bench"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bf16w_bench.py"), "--against", "HEAD", "--ms", "1,130",
                    "--reps", "1", "--out", str(out)], check=True, capture_output=True, timeout=300, cwd=REPO)
    res = json.loads((out / "bf16w_bench.json").read_text())
    assert res["variants"] == ["this tree", "HEAD"] and len(res["rows"]) == 6
    assert all(r["ms"]["HEAD"] > 0 and r["ms"]["this tree"] > 0 for r in res["rows"])
    assert (out / "bf16w_bench.md").exists() and (out / "bf16w_bench.png").exists()
