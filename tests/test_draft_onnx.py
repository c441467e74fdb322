"""ONNX export (cache, atomicity) and OnnxCausalLM: fp32 export equals
transformers' forward; cached/incremental/cropped forwards equal a fresh
forward, in both KV-cache modes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.export import ExportError, ensure_onnx, export_key
from draft_service.onnx_model import OnnxCausalLM

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx

ATOL = 1e-4


def _torch_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()  # [S, V]


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, vocab, n)]


def test_export_is_cached_and_keyed(tiny_models: TinyModels, tiny_onnx: TinyOnnx) -> None:
    t0 = time.perf_counter()
    again = ensure_onnx(tiny_models.draft, tiny_onnx.cache_dir, "fp32", "cpu")
    assert again == tiny_onnx.draft_fp32 and time.perf_counter() - t0 < 1.0
    marker = json.loads((again / "specdec_export.json").read_text())
    assert marker["precision"] == "fp32" and marker["execution"] == "cpu"
    assert tiny_onnx.draft_int4 != tiny_onnx.draft_fp32
    keys = {export_key(tiny_models.draft, p, "cpu") for p in ("fp32", "int4", "int8")}
    keys.add(export_key(tiny_models.target, "fp32", "cpu"))
    assert len(keys) == 4
    # no temporary build directories left behind
    assert not [p for p in (tiny_onnx.cache_dir / "onnx").iterdir() if p.name.startswith(".") and p.name != ".locks"]


def test_export_rejects_bad_inputs(tmp_path: Path, tiny_models: TinyModels) -> None:
    with pytest.raises(ExportError, match="precision"):
        ensure_onnx(tiny_models.draft, tmp_path, "int3", "cpu")
    with pytest.raises(ExportError, match="does not support"):
        ensure_onnx(tiny_models.draft, tmp_path, "fp16", "cpu")
    with pytest.raises(ExportError, match="config.json"):
        ensure_onnx(tmp_path, tmp_path, "fp32", "cpu")


def test_graph_discovery(tiny_onnx: TinyOnnx) -> None:
    m = OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1)
    assert (m.num_layers, m.num_kv_heads, m.head_size, m.vocab_size) == (2, 2, 16, 34)
    assert m.shared_buffer and not m.all_logits and m.device == "cpu"
    assert m.eos_token_ids == [0] and m.context_length == 512


@pytest.mark.parametrize("kv_mode", ["shared", "concat"])
def test_fp32_matches_torch_incrementally_and_after_crops(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, kv_mode: str
) -> None:
    ids = _ids(300, 34)  # crosses the 256-token initial capacity: the buffer grows
    ref = _torch_logits(tiny_models.draft, ids)  # [300, V]
    m = OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1, kv_mode=kv_mode)

    state = m.new_state()
    steps = np.stack([m.forward(state, [t])[-1] for t in ids])
    np.testing.assert_allclose(steps, ref, atol=ATOL, rtol=0)
    assert state.length == 300

    # prefill in one call == last row of the reference
    fresh = m.new_state()
    np.testing.assert_allclose(m.forward(fresh, ids)[-1], ref[-1], atol=ATOL, rtol=0)

    # crop back and feed a *different* continuation: equals a fresh forward on it
    other = ids[:120] + _ids(50, 34, seed=7)
    state.crop(120)
    got = m.forward(state, other[120:])[-1]
    np.testing.assert_allclose(got, _torch_logits(tiny_models.draft, other)[-1], atol=ATOL, rtol=0)
    # crop to zero and restart
    state.crop(0)
    np.testing.assert_allclose(m.forward(state, ids[:10])[-1], ref[9], atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        state.crop(11)


def test_int4_export_runs_and_tracks_fp32(tiny_onnx: TinyOnnx) -> None:
    ids = _ids(64, 34, seed=3)
    f32 = OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1)
    i4 = OnnxCausalLM(tiny_onnx.draft_int4, execution="cpu", intra_op_threads=1)
    s32, s4 = f32.new_state(), i4.new_state()
    a = np.stack([f32.forward(s32, [t])[-1] for t in ids])
    b = np.stack([i4.forward(s4, [t])[-1] for t in ids])
    assert b.shape == a.shape and np.isfinite(b).all()
    # 4-bit weights on a 64-wide random model: close, not equal
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    agree = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert corr > 0.9 and agree > 0.6, (corr, agree)


def test_cache_limit(tiny_onnx: TinyOnnx) -> None:
    m = OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=1, max_cache_tokens=20)
    state = m.new_state()
    m.forward(state, list(range(1, 21)))
    with pytest.raises(ValueError, match="cache limit"):
        m.forward(state, [1])


def test_spin_modes_compute_the_same_logits_and_bad_modes_are_refused(tiny_onnx: TinyOnnx) -> None:
    """The draft's spin mode (on / run / off: how onnxruntime's workers wait)
    changes timing only: the same tokens give bit-identical logits in every
    mode, and an unknown mode is refused by the model and by the config."""
    from draft_service.config import DraftServiceConfig, DrafterSpec

    ids = _ids(12, 34, seed=3)
    outs = []
    for spin in ("on", "run", "off"):
        m = OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", intra_op_threads=2, spin=spin)
        st = m.new_state()
        outs.append(np.concatenate([m.forward(st, ids[:8]), m.forward(st, ids[8:])]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="spin must be one of on, run, off, got 'sometimes'"):
        OnnxCausalLM(tiny_onnx.draft_fp32, execution="cpu", spin="sometimes")
    with pytest.raises(ValueError, match="spin must be one of on, run, off, got 'always'"):
        DraftServiceConfig(drafters=[DrafterSpec(name="tiny", model="m")], spin="always").validate()


def test_draft_floor_script_profiles_the_draft_and_times_its_shapes_on_kquant(tiny_models, tiny_onnx, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """scripts/draft_floor.py on the tiny int4 draft (one round, two tokens a
    side): both sides timed, onnxruntime's profile has its MatMulNBits, and
    the JSON, table and plot are written."""
    import json
    import subprocess
    import sys

    from target_service import kquant
    from tests.stack import REPO

    if kquant.isa() is None:
        pytest.skip("the kquant kernel needs AVX-512 BF16 or AVX2 with FMA")
    out = tmp_path / "floor"
    subprocess.run([sys.executable, str(REPO / "scripts" / "draft_floor.py"), "--model", str(tiny_models.draft),
                    "--cache-dir", str(tiny_onnx.cache_dir), "--rounds", "1", "--passes", "2", "--context", "8",
                    "--out", str(out)], check=True, capture_output=True, timeout=300, cwd=REPO)
    res = json.loads((out / "results.json").read_text())
    assert all(v > 0 for v in res["median_ms"].values()) and len(res["median_ms"]) == 2
    assert res["onnxruntime_ops_ms"]["MatMulNBits"]["calls"] > 0
    assert res["kquant_packed_mb"] > 0
    assert (out / "results.md").exists() and (out / "draft_floor.png").exists()


def test_draft_head_rows_script_cuts_the_head_and_counts_the_tokens_outside(tiny_models, tiny_onnx, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """scripts/draft_head_rows.py on the tiny int4 draft: the cut heads keep
    the full head's logits on their rows (float32 rounding), every variant
    is timed, and the share of tokens outside the rows falls as the rows
    grow, to 0 with every row kept."""
    import json
    import subprocess
    import sys

    from tests.stack import REPO

    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps({"rows": [{"spec_text": "def add(a, b):\n    return a + b\n"},
                                          {"spec_text": "hello world, hello draft"}]}))
    out = tmp_path / "rows"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "draft_head_rows.py"), "--model",
                           str(tiny_models.draft), "--cache-dir", str(tiny_onnx.cache_dir), "--rows", "4,16",
                           "--rounds", "1", "--context", "8", "--corpus-mb", "0.2", "--texts", str(texts),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["median_ms"]) == {"full", "full, re-saved", "V=4", "V=16"}
    assert all(v > 0 for v in res["median_ms"].values())
    assert all(d <= 1e-4 for d in res["kept_rows_max_abs_diff"].values())
    ids = res["outside_share"]["token id"]
    assert ids["4"] > ids["16"] >= 0 and res["target_tokens"] > 0
    assert (out / "results.md").exists() and (out / "head_rows.png").exists()
