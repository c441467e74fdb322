"""File-system helpers: an advisory file lock, atomic JSON writes, durable
renames (fsync of a tree) and cleanup of temporaries left by killed runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from specdec.logging_util import log


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Exclusive advisory ``flock`` on ``path`` (created, with its parent), held
    for the ``with`` block. Blocks until free; ``on_wait`` is called first when
    another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` if missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def temp_sibling(final: Path) -> Path:
    """This process's temporary name for ``final`` (``.<name>.tmp-<pid>``), renamed into place when done."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def remove_stale_temps(final: Path, logger: logging.Logger) -> None:
    """Delete the :func:`temp_sibling` leftovers of killed runs of ``final``.

    Only call it holding the lock that guards ``final``, so no live writer owns them.
    """
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        log(logger, logging.INFO, "removing stale temporary from an interrupted run", path=str(p))
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def fsync_tree(d: Path) -> None:
    """fsync every file in ``d`` (so the rename publishes durable contents)."""
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
