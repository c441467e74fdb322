"""Draft-length policies: how many tokens to draft in the next round.

A policy sees only what is known before the round's verification, so the
choice of γ never affects exactness (design.md, rule 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DraftLengthPolicy(Protocol):
    def next_gamma(self) -> int:
        """γ for the next round; 0 means a plain target decoding step."""

    def observe(self, gamma: int, accepted: int) -> None:
        """Records the outcome of a verified round."""


@dataclass
class FixedPolicy:
    gamma: int

    def next_gamma(self) -> int:
        return self.gamma

    def observe(self, gamma: int, accepted: int) -> None:
        return None


@dataclass
class OffPolicy:
    def next_gamma(self) -> int:
        return 0

    def observe(self, gamma: int, accepted: int) -> None:
        return None
