"""One request's decoding statistics (orchestrator/decode.py fills them in;
GenerationStats, the access log and the bench read them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    committed_in_rounds: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prefill_ms: float = 0.0  # the part of verify_ms that prefilled prompts (and rebuilds)
    cached_prompt_tokens: int = 0  # prompt tokens the target took from its prefix cache
    draft_cached_prompt_tokens: int = 0  # the same for the draft session
    rtt_ms: float = 0.0  # RPC wall time minus server compute, summed
    draft_failures: int = 0
    target_rebuilds: int = 0
    gamma_trajectory: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    draft_mode: str = "unary"
    draft_hidden_ms: float = 0.0  # draft compute of verified spans that ran while the target verified
    post_verified: int = 0  # rounds whose next token was a run-ahead token post-verified and accepted
    round_overhead_ms: list[float] = field(default_factory=list)  # per round: wall - target - exposed draft compute
    lookup_rounds: int = 0  # rounds that verified the orchestrator's own prompt-lookup span (orchestrator/lookup.py)
    lookup_tokens: int = 0  # tokens those rounds drafted (in draft_tokens too)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def count_lookup_round(self, drafted: int) -> None:
        self.lookup_rounds += 1
        self.lookup_tokens += drafted

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def round_overhead_p50_ms(self) -> float:
        return float(np.median(self.round_overhead_ms)) if self.round_overhead_ms else 0.0

    @property
    def round_overhead_p99_ms(self) -> float:
        return float(np.percentile(self.round_overhead_ms, 99)) if self.round_overhead_ms else 0.0
