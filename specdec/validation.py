"""Request checks shared by the services: one wording, one status
(INVALID_ARGUMENT) for the same mistake wherever it is made. Each check
names the request field it reads (``what``) in its message.

Pure functions, no gRPC: the servicers call them before any model work, and
the domain objects (the draft's chain, the target engine) call them where
they take their input, so a check cannot be skipped by a new entry point.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specdec.errors import InvalidArgument

__all__ = ["check_min_confidence", "check_token_id", "check_token_ids"]


def _outside(t: int, vocab_size: int) -> str:
    return f"token id {t}, outside the vocabulary [0, {vocab_size})"


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> None:
    """Every id in ``ids`` is in [0, vocab_size); the first one that is not is
    named. Numpy arrays (a q's support) are checked vectorised."""
    if isinstance(ids, np.ndarray):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise InvalidArgument(f"{what} contains {_outside(bad, vocab_size)}")
        return
    for t in ids:
        if t < 0 or t >= vocab_size:
            raise InvalidArgument(f"{what} contains {_outside(int(t), vocab_size)}")


def check_token_id(t: int, vocab_size: int, what: str) -> None:
    """One id in [0, vocab_size)."""
    if t < 0 or t >= vocab_size:
        raise InvalidArgument(f"{what} {t} is outside the vocabulary [0, {vocab_size})")


def check_min_confidence(value: float, what: str = "min_confidence", *, allow_one: bool = True) -> float:
    """A draft confidence threshold: in [0, 1] (``allow_one``) or [0, 1)
    (the orchestrator's request field, where 1 would end every span at its
    first token). NaN is refused. Returns it as a float."""
    v = float(value)
    ok = 0.0 <= v <= 1.0 if allow_one else 0.0 <= v < 1.0
    if not ok or math.isnan(v):
        raise InvalidArgument(f"{what} must be in [0, {'1]' if allow_one else '1)'}, got {v}")
    return v
