"""Build and load the target's small C kernels (``bf16w``, ``kquant``): one
place that finds the compiler, compiles a source once per machine into the
kernel cache and loads it with ctypes, and hands the kernels their input
rows. Plain Python, no gRPC.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

_lock = threading.Lock()


def compiler() -> str | None:
    """The C compiler to use ($CC, cc, gcc or clang), or None."""
    for cc in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def kernel_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"specdec-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"


def load(name: str, source: str, flags: Sequence[str]) -> tuple[ctypes.CDLL | None, str]:
    """(the library compiled from ``source`` with ``flags``, "") or (None, why
    not). The library is named by a digest of the source and flags, so a
    changed kernel is rebuilt, and an unchanged one is compiled once per
    machine."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"x86-64 only (this is {platform.machine()})"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    root = kernel_dir()
    lib = root / f"{name}-{digest}.so"
    with _lock:
        if not lib.exists():
            root.mkdir(parents=True, exist_ok=True)
            src = root / f"{name}-{digest}.{os.getpid()}.c"
            tmp = root / f"{name}-{digest}.{os.getpid()}.so"
            src.write_text(source)
            try:
                subprocess.run([cc, *flags, "-o", str(tmp), str(src)], check=True, capture_output=True, timeout=180)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
                err = getattr(e, "stderr", b"") or b""
                return None, f"compiling the {name} kernel failed: {e} {err.decode(errors='replace')[:400]}"
            finally:
                src.unlink(missing_ok=True)
            os.replace(tmp, lib)
        return ctypes.CDLL(str(lib)), ""


def float_rows(x, k: int):  # type: ignore[no-untyped-def]
    """A torch tensor [..., k] as contiguous float32 rows [M, k] (what the
    kernels read) and M."""
    import torch

    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    x2 = x2.contiguous()
    return x2, int(x2.shape[0])
