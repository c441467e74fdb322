"""Process memory: resident set size, glibc's heap figures, and handing
freed heap memory back to the system. Plain Python and ctypes; everything
degrades to a no-op (or None) where glibc is not the allocator.

Why a service needs this (issue 26's chat soak, scripts/kv_rss_probe.py):
transformers' KV cache grows by ``torch.cat`` every step, so the process
frees a tensor and allocates a slightly larger one, per layer, per session
(the target now appends in place instead: target_service/kv_adapter.py
GrowingLayer), a batched forward pads each layer's rows into one batch,
and prefix-cache entries and sessions come and go with whole copies of
their KV. Those tensors
(0.1–30 MB) sit below glibc's *dynamic* mmap threshold once one of that
size was freed (the threshold rises to the largest freed mmapped chunk, up
to 32 MiB), so they come from the heap, which keeps what is freed (a hole
between live chunks is never returned; the top only past
``M_TRIM_THRESHOLD``, which rises with it). RSS then follows the
high-water mark of those copies and the heap's holes, not the KV that is
live. :func:`release_free_memory` (``malloc_trim(0)``) returns every free
page of every arena, holes included (glibc >= 2.8); it costs a pass over
the free lists and the kernel's unmapping of those pages (about 0.1 s for
1 GiB free on a busy 2-core machine), hence :class:`TrimPacer`. Between
two trims the heap still grows with what was freed;
:func:`set_mmap_threshold` keeps large blocks out of the heap altogether
(each freed block's pages go back at once), which is what the services
do by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

__all__ = ["heap_info", "release_free_memory", "rss_bytes", "set_mmap_threshold", "TrimPacer"]

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of ``pid`` (VmRSS), 0 where /proc is not readable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    if os.name != "posix":
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") else None


_LIBC = _libc()


def heap_info() -> dict[str, int]:
    """glibc's heap figures over all arenas (mallinfo2, glibc >= 2.33), in
    bytes: ``heap_in_use`` (allocated from the heap), ``heap_free`` (freed,
    still held by the process), ``mmapped`` (chunks mapped on their own);
    {} without it."""
    fn = getattr(_LIBC, "mallinfo2", None) if _LIBC is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    mi = fn()
    return {"heap_in_use": int(mi.uordblks), "heap_free": int(mi.fordblks), "mmapped": int(mi.hblkhd)}


def release_free_memory() -> bool:
    """``malloc_trim(0)``: hands every free heap page back to the system;
    True when some memory was released (False, too, without glibc)."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(ctypes.c_size_t(0)))


#: glibc's largest M_MMAP_THRESHOLD (HEAP_MAX_SIZE / 2 on 64-bit)
MAX_MMAP_THRESHOLD = 32 << 20
#: the services' default: large blocks (KV buffers, logits) get pages of their own
DEFAULT_MMAP_THRESHOLD = 256 << 10


def check_mmap_threshold(nbytes: int, field: str = "memory_mmap_threshold_bytes") -> None:
    """ValueError unless ``nbytes`` is a threshold :func:`set_mmap_threshold` takes."""
    if not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"{field} must be in [0, 32 MiB] (glibc's limit; 0 = glibc's dynamic threshold), "
                         f"got {nbytes}")


def set_mmap_threshold(nbytes: int) -> bool:
    """Fixes glibc's mmap threshold at ``nbytes`` (``mallopt(M_MMAP_THRESHOLD)``):
    every allocation of at least that size gets pages of its own, which go
    back to the system when it is freed, and the threshold no longer rises
    to the largest chunk freed. For a service whose large tensors (KV
    buffers, a forward's activations and logits) come and go with its
    sessions, RSS then follows what is live instead of the heap's
    high-water mark between trims (issue 26's soak). The price is a page
    fault per 4 KiB the first time such a block is touched. ``nbytes`` <= 0
    leaves glibc's dynamic threshold; False without glibc or when refused."""
    if nbytes <= 0 or _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    return bool(_LIBC.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(int(nbytes))))


class TrimPacer:
    """Calls :func:`release_free_memory` when asked, at most once every
    ``min_interval_s`` seconds (a trim walks the free lists: a few
    milliseconds on a heap of GiBs) and only when glibc holds at least
    ``min_free_bytes`` freed; ``min_interval_s`` < 0 turns it off."""

    def __init__(self, min_interval_s: float = 1.0, min_free_bytes: int = 64 << 20) -> None:
        self.min_interval_s = min_interval_s
        self.min_free_bytes = min_free_bytes
        self._last = 0.0
        self._lock = threading.Lock()
        self.trims = 0  # malloc_trim calls
        self.seconds = 0.0  # spent in them

    def maybe_trim(self) -> bool:
        if self.min_interval_s < 0 or _LIBC is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.min_interval_s:
                return False
            self._last = now
        free = heap_info().get("heap_free")
        if free is not None and free < self.min_free_bytes:
            return False
        t0 = time.perf_counter()
        released = release_free_memory()
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        return released
