"""Build and load the target's small C kernels (``bf16w``, ``kquant``): one
place that finds the compiler, compiles a source once per machine into the
kernel cache and loads it with ctypes, and hands the kernels their input
rows. Plain Python, no gRPC.

Where a library comes from, in order (docs/security.md, "Kernel cache"):

1. ``$SPECDEC_KERNEL_DIR``: a prebuilt, read-only directory (the images
   build one with ``python -m target_service.cbuild build DIR``). It must be
   owned by root or this user and writable by nobody else.
2. The kernel cache, ``<cache dir>/kernels`` (``$SPECDEC_CACHE_DIR`` or
   ``~/.cache/specdec``): created with mode 0700 and used only while it is
   owned by this user with no group or other access; otherwise the kernels
   are built into a fresh private temporary directory for this process.

Every library ``<name>-<digest of source and flags>.so`` has a sidecar
``.so.sha256`` holding the SHA-256 of its bytes. A library is loaded only
when the file (owned by this user or root, writable by nobody else) hashes
to its sidecar's digest, and the bytes hashed are the bytes ``dlopen`` maps
(it opens ``/proc/self/fd/N`` of the file it hashed). A library that fails
the check is rebuilt (in the cache) or skipped (prebuilt). Builds write
through unpredictable temporary names (``mkstemp`` in the same directory)
and ``os.replace``, under a file lock, so concurrent processes never load a
half-written library.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specdec.fsutil import file_lock
from specdec.logging_util import log

logger = logging.getLogger("specdec.target.kernels")
_lock = threading.Lock()
_private: Path | None = None  # this process's fallback directory when the cache is unsafe
# descriptors of loaded libraries, kept open: dlopen knows them by their
# /proc/self/fd/N name, which a reused descriptor number would alias
_held: list[int] = []

KERNEL_DIR_ENV = "SPECDEC_KERNEL_DIR"


@dataclass(frozen=True)
class Kernel:
    """One library to build: ``name`` (file prefix), C ``source`` and compiler ``flags``."""

    name: str
    source: str
    flags: tuple[str, ...]

    @property
    def filename(self) -> str:
        digest = hashlib.sha256((self.source + " ".join(self.flags)).encode()).hexdigest()[:16]
        return f"{self.name}-{digest}.so"


def compiler() -> str | None:
    """The C compiler to use ($CC, cc, gcc or clang), or None."""
    for cc in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def kernel_dir() -> Path:
    """The kernel cache: ``<specdec cache dir>/kernels``."""
    from specdec.models.spec import default_cache_dir

    return default_cache_dir() / "kernels"


def prebuilt_dir() -> Path | None:
    env = os.environ.get(KERNEL_DIR_ENV, "")
    return Path(env).expanduser() if env else None


def unsafe_reason(st: os.stat_result, what: str, *, private: bool) -> str:
    """Why a file or directory with this ``stat`` must not be trusted ("" if
    it may): owned by another user (root is accepted unless ``private``), or
    writable by group or others (``private``: any group or other access)."""
    uid = os.getuid()
    if st.st_uid != uid and (private or st.st_uid != 0):
        return f"{what} is owned by uid {st.st_uid}, not {uid}" + ("" if private else " or root")
    mask = 0o077 if private else 0o022
    if stat.S_IMODE(st.st_mode) & mask:
        return f"{what} has mode {stat.S_IMODE(st.st_mode):04o} (must not be {'accessible' if private else 'writable'} " \
               f"by group or others)"
    return ""


def _private_cache() -> Path:
    """A kernel cache directory that is safe to use: creates it 0700; when it
    exists with the wrong owner or mode, a fresh private temporary directory
    for this process instead (logged)."""
    global _private
    root = kernel_dir()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
        why = "it is not a directory" if not stat.S_ISDIR(st.st_mode) else unsafe_reason(st, str(root), private=True)
    except OSError as e:
        why = f"cannot create it: {e.strerror or e}"
    if not why:
        return root
    if _private is None:
        _private = Path(tempfile.mkdtemp(prefix="specdec-kernels-"))
        log(logger, logging.WARNING, "refusing the kernel cache; building the kernels into a private directory",
            cache=str(root), reason=why, using=str(_private))
    return _private


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _recorded_digest(lib: Path) -> str:
    try:
        return lib.with_name(lib.name + ".sha256").read_text().split()[0]
    except (OSError, IndexError):
        return ""


def open_verified(lib: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the library at ``lib``, "") when it is owned by this user or root,
    writable by nobody else and hashes to its sidecar's digest; else (None,
    why not). The bytes checked are the bytes loaded (``/proc/self/fd``)."""
    try:
        fd = os.open(lib, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        return None, f"{lib}: {e.strerror or e}"
    try:
        st = os.fstat(fd)
        why = unsafe_reason(st, str(lib), private=False) if stat.S_ISREG(st.st_mode) else f"{lib} is not a file"
        if why:
            return None, why
        want = _recorded_digest(lib)
        got = _sha256_fd(fd)
        if not want:
            return None, f"{lib} has no digest sidecar"
        if got != want:
            return None, f"{lib} does not match its recorded SHA-256"
        via = f"/proc/self/fd/{fd}"
        dll = ctypes.CDLL(via if os.path.exists(via) else str(lib))
        _held.append(fd)
        return dll, ""
    except OSError as e:
        return None, f"{lib}: {e}"
    finally:
        if fd not in _held:
            os.close(fd)


def _write_atomic(final: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build(kernel: Kernel, root: Path, cc: str) -> tuple[Path | None, str]:
    """Compiles ``kernel`` into ``root`` (library + digest sidecar, each
    through a temporary name and a rename); (its path, "") or (None, why not)."""
    lib = root / kernel.filename
    fd, src = tempfile.mkstemp(dir=root, prefix=f".{kernel.name}.", suffix=".c")
    with os.fdopen(fd, "w") as f:
        f.write(kernel.source)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{kernel.name}.", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, *kernel.flags, "-o", tmp, src], check=True, capture_output=True, timeout=180)
        data = Path(tmp).read_bytes()
        _write_atomic(lib.with_name(lib.name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {lib.name}\n".encode())
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)  # after its sidecar: a reader sees a matching pair or rebuilds
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        err = getattr(e, "stderr", b"") or b""
        return None, f"compiling the {kernel.name} kernel failed: {e} {err.decode(errors='replace')[:400]}"
    finally:
        Path(src).unlink(missing_ok=True)
        Path(tmp).unlink(missing_ok=True)
    return lib, ""


def load(kernel: Kernel) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from ``kernel``, "") or (None, why not): from the
    prebuilt directory when it holds a verified copy, else from the kernel
    cache, compiled there when missing or failing its check."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"x86-64 only (this is {platform.machine()})"
    name = kernel.name
    reasons = []
    pre = prebuilt_dir()
    if pre is not None:
        try:
            why = unsafe_reason(os.stat(pre), str(pre), private=False)
        except OSError as e:
            why = f"{KERNEL_DIR_ENV} {pre}: {e.strerror or e}"
        if not why:
            dll, why = open_verified(pre / kernel.filename)
            if dll is not None:
                return dll, ""
        log(logger, logging.WARNING, "prebuilt kernel not used", kernel=name, reason=why)
        reasons.append(why)
    with _lock:
        root = _private_cache()
        with file_lock(root / ".lock"):
            lib = root / kernel.filename
            if lib.exists():
                dll, why = open_verified(lib)
                if dll is not None:
                    return dll, ""
                log(logger, logging.WARNING, "cached kernel failed its check; rebuilding", kernel=name, reason=why)
            cc = compiler()
            if cc is None:
                reasons.append("no C compiler (cc, gcc or clang) on PATH")
                return None, "; ".join(reasons)
            built, why = build(kernel, root, cc)
            if built is None:
                return None, why
            return open_verified(built)


def all_kernels() -> list[Kernel]:
    """Every library the target can load (each ISA variant), for prebuilding."""
    from target_service import bf16w, kquant

    return [*bf16w.kernels(), *kquant.kernels()]


def build_dir(out: Path, kernels: Sequence[Kernel] | None = None) -> list[Path]:
    """Builds ``kernels`` (default: all) into ``out`` for use as
    ``$SPECDEC_KERNEL_DIR``; raises RuntimeError when one does not build."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for k in kernels if kernels is not None else all_kernels():
        lib, why = build(k, out, cc)
        if lib is None:
            raise RuntimeError(why)
        built.append(lib)
    os.chmod(out, 0o755)
    return built


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m target_service.cbuild",
                                description="Prebuild the target's C kernels (bf16w, kquant) for SPECDEC_KERNEL_DIR.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build every kernel into DIR")
    b.add_argument("dir", type=Path)
    a = p.parse_args(argv)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"cbuild: skipped, the kernels are x86-64 only (this is {platform.machine()})")
        a.dir.mkdir(parents=True, exist_ok=True)
        return 0
    try:
        libs = build_dir(a.dir)
    except RuntimeError as e:
        print(f"cbuild: {e}", file=sys.stderr)
        return 1
    for lib in libs:
        print(f"cbuild: {lib} sha256={_recorded_digest(lib)}")
    return 0


def float_rows(x, k: int):  # type: ignore[no-untyped-def]
    """A torch tensor [..., k] as contiguous float32 rows [M, k] (what the
    kernels read) and M."""
    import torch

    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    x2 = x2.contiguous()
    return x2, int(x2.shape[0])


if __name__ == "__main__":
    raise SystemExit(main())
