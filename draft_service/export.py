"""HF causal-LM directory -> ONNX (with past key values), cached on disk.

Runs onnxruntime-genai's model builder as a subprocess (it imports its own
modules by path and keeps large tensors alive, so a child process also returns
its memory, about 6.6 GB peak for a 0.5B model). The result is cached under
``<cache_dir>/onnx/<key>/``; the key hashes a cheap fingerprint of the HF
directory (config, names/sizes/mtimes of weight files), the precision, the
execution provider, the builder version and this module's export options.
Builds go to a temporary directory renamed into place (atomic), under a file
lock so concurrent processes build a key once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specdec.fsutil import file_lock
from specdec.logging_util import log

logger = logging.getLogger("specdec.draft.export")

# Bump when the export options below change the produced graph.
EXPORT_FORMAT_VERSION = 1
PRECISIONS = ("int4", "int8", "fp16", "bf16", "fp32")
# (precision, execution provider) pairs the builder supports
_SUPPORTED = {
    ("fp32", "cpu"),
    ("int8", "cpu"),
    ("int4", "cpu"),
    ("fp32", "cuda"),
    ("fp16", "cuda"),
    ("bf16", "cuda"),
    ("int8", "cuda"),
    ("int4", "cuda"),
}
# Drafting needs only the last position's logits: a pruned LM head avoids a
# [S, V] projection on prefill (V = 151,936 for Qwen2.5).
_EXTRA_OPTIONS = {"prune_lm_head": "true"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_MARKER = "specdec_export.json"
_HASH_CONTENT_BYTES = 64 << 20


class ExportError(RuntimeError):
    pass


def builder_version() -> str:
    import onnxruntime_genai

    return str(getattr(onnxruntime_genai, "__version__", "unknown"))


def hf_fingerprint(hf_dir: Path) -> str:
    """Cheap identity of an HF directory: config.json bytes plus, per weight
    file, its name and either its bytes (files up to 64 MiB: tiny test models
    get a content key, stable across rebuilds) or its size and mtime."""
    h = hashlib.sha256()
    cfg = hf_dir / "config.json"
    if not cfg.is_file():
        raise ExportError(f"{hf_dir} is not an HF model directory (no config.json)")
    h.update(cfg.read_bytes())
    weights = sorted(p for p in hf_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise ExportError(f"{hf_dir} has no weight files")
    for p in weights:
        st = p.stat()
        if st.st_size <= _HASH_CONTENT_BYTES:
            h.update(f"{p.name}\0".encode() + hashlib.sha256(p.read_bytes()).digest())
        else:
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        h.update(index.read_bytes())
    return h.hexdigest()


def export_key(hf_dir: Path, precision: str, execution: str) -> str:
    payload = json.dumps(
        {
            "hf": hf_fingerprint(hf_dir),
            "precision": precision,
            "execution": execution,
            "builder": builder_version(),
            "format": EXPORT_FORMAT_VERSION,
            "extra": _EXTRA_OPTIONS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def ensure_onnx(hf_dir: Path, cache_dir: Path, precision: str = "int4", execution: str = "cpu") -> Path:
    """Returns the directory holding ``model.onnx`` for ``hf_dir``, exporting it
    on first use. ``execution`` is the concrete provider, 'cpu' or 'cuda'."""
    hf_dir = Path(hf_dir).resolve()
    cache_dir = Path(cache_dir).expanduser()
    if precision not in PRECISIONS:
        raise ExportError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if (precision, execution) not in _SUPPORTED:
        raise ExportError(f"the model builder does not support {precision} on {execution}")
    key = export_key(hf_dir, precision, execution)
    root = cache_dir / "onnx"
    out = root / key
    if (out / _MARKER).is_file():
        log(logger, logging.INFO, "onnx export cached", path=str(out), precision=precision)
        return out
    with file_lock(root / ".locks" / f"{key}.lock"):
        if (out / _MARKER).is_file():  # built by another process meanwhile
            return out
        if out.exists():  # a partial directory without marker: never trusted
            shutil.rmtree(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            _run_builder(hf_dir, tmp / "model", tmp / "cache", precision, execution)
            model_dir = tmp / "model"
            if not (model_dir / "model.onnx").is_file():
                raise ExportError(f"builder produced no model.onnx in {model_dir}")
            shutil.rmtree(tmp / "cache", ignore_errors=True)
            size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
            (model_dir / _MARKER).write_text(
                json.dumps(
                    {
                        "hf_dir": str(hf_dir),
                        "precision": precision,
                        "execution": execution,
                        "builder": builder_version(),
                        "format": EXPORT_FORMAT_VERSION,
                        "extra": _EXTRA_OPTIONS,
                        "bytes": size,
                        "created": time.time(),
                    },
                    indent=1,
                )
            )
            os.rename(model_dir, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(logger, logging.INFO, "onnx export ready", path=str(out), precision=precision, execution=execution)
    return out


def _run_builder(hf_dir: Path, out: Path, cache: Path, precision: str, execution: str) -> None:
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        execution,
        "-c",
        str(cache),
        "--extra_options",
        *(f"{k}={v}" for k, v in _EXTRA_OPTIONS.items()),
    ]
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    log(logger, logging.INFO, "onnx export started", hf_dir=str(hf_dir), precision=precision, execution=execution)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=str(out.parent),
        env=env,
    )
    tail: list[str] = []
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(15.0):
            log(logger, logging.INFO, "onnx export running", elapsed_s=round(time.perf_counter() - started, 1))

    hb = threading.Thread(target=heartbeat, daemon=True)
    hb.start()
    try:
        assert proc.stdout is not None
        buf = b""
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            buf += chunk
            # progress bars redraw with \r; treat it as a line end
            parts = buf.replace(b"\r", b"\n").split(b"\n")
            buf = parts.pop()
            for raw in parts:
                _builder_line(raw.decode(errors="replace").strip(), started, tail)
        if buf:
            _builder_line(buf.decode(errors="replace").strip(), started, tail)
        rc = proc.wait()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elapsed = round(time.perf_counter() - started, 1)
    if rc != 0:
        log(logger, logging.ERROR, "onnx export failed", rc=rc, elapsed_s=elapsed, tail="\n".join(tail))
        raise ExportError(f"model builder exited with {rc}: {' | '.join(tail[-5:])}")
    log(logger, logging.INFO, "onnx export finished", elapsed_s=elapsed)


def _builder_line(line: str, started: float, tail: list[str]) -> None:
    if not line:
        return
    tail.append(line)
    del tail[:-30]
    progress_bar = "it/s]" in line or "%|" in line
    level = logging.DEBUG if progress_bar else logging.INFO
    log(logger, level, "builder", line=line[:500], elapsed_s=round(time.perf_counter() - started, 1))
