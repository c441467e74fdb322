"""Progress reporting for long model preparation steps: tqdm byte bars,
stage logs with a heartbeat, and the RSS figures they carry."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any, Iterator

from specdec.logging_util import log

logger = logging.getLogger("specdec.models")


def rss_mb(pid: int | str = "self") -> float | None:
    """Current resident set size of ``pid`` (default: this process) in MiB (Linux), else ``None``."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def peak_rss_mb() -> float | None:
    """This process's peak RSS in MiB (Linux ``ru_maxrss`` is in KiB)."""
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):  # pragma: no cover
        return None


def stderr_fd() -> int | None:
    """Our stderr as a file descriptor for child processes (``None`` = inherit)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
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


@contextlib.contextmanager
def _heartbeat(stage: str, interval_s: float = 10.0, **fields: Any) -> Iterator[None]:
    """Log ``stage`` start/done and a heartbeat every ``interval_s`` with elapsed time and RSS."""
    t0 = time.monotonic()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            log(logger, logging.INFO, f"{stage}: still working", stage=stage,
                elapsed_s=round(time.monotonic() - t0, 1), rss_mb=rss_mb(), **fields)

    log(logger, logging.INFO, f"{stage}: start", stage=stage, rss_mb=rss_mb(), **fields)
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
            stage=stage, elapsed_s=round(time.monotonic() - t0, 1), rss_mb=rss_mb(), **fields)


@contextlib.contextmanager
def _stage_log(stage: str, **fields: Any) -> Iterator[None]:
    """Log a stage's start and end (elapsed time, RSS), without a heartbeat thread."""
    t0 = time.monotonic()
    log(logger, logging.INFO, f"{stage}: start", stage=stage, rss_mb=rss_mb(), **fields)
    yield
    log(logger, logging.INFO, f"{stage}: done", stage=stage, elapsed_s=round(time.monotonic() - t0, 1),
        rss_mb=rss_mb(), **fields)


def logged_stage(stage: str, heartbeat_s: float | None, **fields: Any) -> contextlib.AbstractContextManager[None]:
    """Log ``stage`` with a heartbeat every ``heartbeat_s`` if set, else its start and end only."""
    if heartbeat_s:
        return _heartbeat(stage, heartbeat_s, **fields)
    return _stage_log(stage, **fields)
