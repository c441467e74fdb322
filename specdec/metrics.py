"""Prometheus metrics: one registry per service, served on ``/metrics``.

Counters follow vLLM's spec-decode metrics (drafts, draft tokens, accepted
tokens, accepted tokens per position); histograms cover round, draft, verify
and round-trip time; gauges cover active sessions/streams. PromQL:

    acceptance rate:       rate(specdec_spec_decode_num_accepted_tokens_total[5m])
                           / rate(specdec_spec_decode_num_draft_tokens_total[5m])
    mean accepted length:  1 + rate(specdec_spec_decode_num_accepted_tokens_total[5m])
                           / rate(specdec_spec_decode_num_drafts_total[5m])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specdec.logging_util import log

logger = logging.getLogger("specdec.metrics")

# seconds: 1 ms … 30 s
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> int | None:
    """Starts the /metrics HTTP endpoint; port 0 = disabled. Returns the port."""
    if port <= 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    log(logger, logging.INFO, "metrics endpoint", url=f"http://{host}:{bound}/metrics")
    return bound


@dataclass
class OrchestratorMetrics:
    registry: CollectorRegistry
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    accepted_per_pos: Counter
    num_draft_tokens_stopped: Counter
    rounds: Counter
    generated_tokens: Counter
    requests: Counter
    draft_failures: Counter
    target_rebuilds: Counter
    round_time: Histogram
    draft_time: Histogram
    verify_time: Histogram
    round_trip_time: Histogram
    ttft: Histogram
    active_streams: Gauge
    target_sessions_created: Counter
    draft_sessions_created: Counter
    upstream_failures: Counter
    upstream_sessions: Gauge
    upstream_replicas: Gauge

    @classmethod
    def create(cls) -> "OrchestratorMetrics":
        r = CollectorRegistry()
        return cls(
            registry=r,
            num_drafts=Counter("specdec_spec_decode_num_drafts", "Rounds that verified a drafted span (γ > 0).", ["drafter"], registry=r),
            num_draft_tokens=Counter("specdec_spec_decode_num_draft_tokens", "Drafted tokens sent for verification.", ["drafter"], registry=r),
            num_accepted_tokens=Counter("specdec_spec_decode_num_accepted_tokens", "Drafted tokens accepted by the target.", ["drafter"], registry=r),
            accepted_per_pos=Counter("specdec_spec_decode_num_accepted_tokens_per_pos", "Accepted drafted tokens by position in the span (0-based).", ["drafter", "position"], registry=r),
            num_draft_tokens_stopped=Counter("specdec_spec_decode_num_draft_tokens_stopped", "Tokens the policy asked for but the drafter did not draft (confidence early stop, context limit).", ["drafter"], registry=r),
            rounds=Counter("specdec_rounds", "Verify rounds (including γ = 0 plain decoding steps).", registry=r),
            generated_tokens=Counter("specdec_generated_tokens", "Tokens streamed to clients.", registry=r),
            requests=Counter("specdec_requests", "Generate requests by final gRPC status code (rejected and cancelled "
                             "ones included; finish_reason NONE when no stream finished).", ["finish_reason", "code"], registry=r),
            draft_failures=Counter("specdec_draft_failures", "Rounds that fell back to target-only because the draft failed.", registry=r),
            target_rebuilds=Counter("specdec_target_session_rebuilds", "Target sessions rebuilt from the orchestrator's tokens.", registry=r),
            round_time=Histogram("specdec_round_seconds", "Wall time of one draft + verify round.", buckets=_BUCKETS, registry=r),
            draft_time=Histogram("specdec_draft_seconds", "Draft-service compute per Propose.", buckets=_BUCKETS, registry=r),
            verify_time=Histogram("specdec_verify_seconds", "Target-service compute per Verify.", buckets=_BUCKETS, registry=r),
            round_trip_time=Histogram("specdec_round_trip_seconds", "RPC wall time minus server compute (network, queueing, serialization), per call.", ["service"], buckets=_BUCKETS, registry=r),
            ttft=Histogram("specdec_time_to_first_token_seconds", "Time to first token.", buckets=_BUCKETS, registry=r),
            active_streams=Gauge("specdec_active_streams", "Generate streams in progress.", registry=r),
            target_sessions_created=Counter("specdec_orchestrator_target_sessions_created", "Target sessions (prefills, rebuilds included) created, by replica.", ["replica"], registry=r),
            draft_sessions_created=Counter("specdec_orchestrator_draft_sessions_created", "Draft sessions created, by replica.", ["replica"], registry=r),
            upstream_failures=Counter("specdec_orchestrator_upstream_failures", "Calls that failed with UNAVAILABLE or a dead connection (the replica is backed off).", ["service", "replica"], registry=r),
            upstream_sessions=Gauge("specdec_orchestrator_upstream_sessions", "Sessions this orchestrator holds, by replica.", ["service", "replica"], registry=r),
            upstream_replicas=Gauge("specdec_orchestrator_upstream_replicas", "Known replicas by state (available = SERVING and not backed off).", ["service", "state"], registry=r),
        )


@dataclass
class ModelServiceMetrics:
    """Shared by the target and draft services (prefix ``specdec_target_`` / ``specdec_draft_``)."""

    registry: CollectorRegistry
    calls: Counter
    tokens: Counter
    compute_time: Histogram
    queue_time: Histogram
    active_sessions: Gauge
    queue_depth: Gauge
    evictions: Counter

    @classmethod
    def create(cls, service: str) -> "ModelServiceMetrics":
        r = CollectorRegistry()
        p = f"specdec_{service}"
        return cls(
            registry=r,
            calls=Counter(f"{p}_calls", "Model calls served.", ["method"], registry=r),
            tokens=Counter(f"{p}_tokens", "Tokens processed by forward passes.", ["method"], registry=r),
            compute_time=Histogram(f"{p}_compute_seconds", "Model compute per call.", ["method"], buckets=_BUCKETS, registry=r),
            queue_time=Histogram(f"{p}_queue_seconds", "Time a call waited for the model worker.", ["method"], buckets=_BUCKETS, registry=r),
            active_sessions=Gauge(f"{p}_active_sessions", "Sessions holding state.", registry=r),
            queue_depth=Gauge(f"{p}_queue_depth", "Model jobs waiting or running.", registry=r),
            evictions=Counter(f"{p}_session_evictions", "Sessions evicted (budget, TTL).", registry=r),
        )

    def observe(self, method: str, tokens: int, queue_ms: float, compute_ms: float) -> None:
        self.calls.labels(method).inc()
        self.tokens.labels(method).inc(tokens)
        self.compute_time.labels(method).observe(compute_ms / 1e3)
        self.queue_time.labels(method).observe(queue_ms / 1e3)


_BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class BatchMetrics:
    """The target's batched forward passes (registered on its service registry)."""

    forwards: Counter
    batch_size: Histogram
    batch_tokens: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str = "target") -> "BatchMetrics":
        p = f"specdec_{service}"
        return cls(
            forwards=Counter(f"{p}_forward_passes", "Model forward passes (one per batch).", ["batched"], registry=registry),
            batch_size=Histogram(f"{p}_batch_size", "Rows (calls from different sessions) per forward pass.",
                                 buckets=_BATCH_SIZE_BUCKETS, registry=registry),
            batch_tokens=Histogram(f"{p}_batch_tokens", "Real input tokens per forward pass.",
                                   buckets=_BATCH_TOKEN_BUCKETS, registry=registry),
        )

    def observe(self, batch_size: int, batch_tokens: int) -> None:
        self.forwards.labels("yes" if batch_size > 1 else "no").inc()
        self.batch_size.observe(batch_size)
        self.batch_tokens.observe(batch_tokens)


@dataclass
class KVMetrics:
    """A model service's KV budget and prefix cache (names after vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``, counted in tokens)."""

    prefix_queries: Counter
    prefix_hits: Counter
    used_tokens: Gauge
    budget_tokens: Gauge
    used_bytes: Gauge
    budget_bytes: Gauge
    prefix_entries: Gauge
    prefix_tokens: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str) -> "KVMetrics":
        p, r = f"specdec_{service}", registry
        return cls(
            prefix_queries=Counter(f"{p}_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", registry=r),
            prefix_hits=Counter(f"{p}_prefix_cache_hits_tokens", "Prompt tokens taken from the prefix cache (not prefilled).", registry=r),
            used_tokens=Gauge(f"{p}_kv_used_tokens", "KV tokens held: sessions, prefills in progress, prefix-cache entries.", registry=r),
            budget_tokens=Gauge(f"{p}_kv_budget_tokens", "The KV budget in tokens.", registry=r),
            used_bytes=Gauge(f"{p}_kv_used_bytes", "KV bytes held (K+V over all layers).", registry=r),
            budget_bytes=Gauge(f"{p}_kv_budget_bytes", "The KV budget in bytes.", registry=r),
            prefix_entries=Gauge(f"{p}_prefix_cache_entries", "Prefixes stored in the prefix cache.", registry=r),
            prefix_tokens=Gauge(f"{p}_prefix_cache_tokens", "Tokens the prefix cache's entries hold.", registry=r),
        )


def export_calibration(registry: CollectorRegistry, result: object, isa: str) -> None:
    """The target's start-up calibration as gauges: every measured pair's
    t(k) (``specdec_target_forward_cost_ms{dtype,backend,tokens}``), its
    score, and the chosen pair (``specdec_target_numerics_info`` = 1)."""
    cost = Gauge("specdec_target_forward_cost_ms", "Measured forward-pass time of k tokens at start-up, per (dtype, backend).",
                 ["dtype", "backend", "tokens"], registry=registry)
    score = Gauge("specdec_target_calibration_score_tokens_per_second",
                  "Mean expected throughput under AUTO over the acceptance mix, per calibrated (dtype, backend).",
                  ["dtype", "backend"], registry=registry)
    info = Gauge("specdec_target_numerics_info", "The target's chosen numerics (value 1).",
                 ["dtype", "backend", "chosen_by", "isa"], registry=registry)
    for key, curve in result.curves.items():  # type: ignore[attr-defined]
        dtype, backend = key.split("/")
        for k, ms in curve.items():
            cost.labels(dtype, backend, str(k)).set(ms)
        if key in result.scores:  # type: ignore[attr-defined]
            score.labels(dtype, backend).set(result.scores[key])  # type: ignore[attr-defined]
    info.labels(result.dtype, result.backend, result.chosen_by, isa).set(1)  # type: ignore[attr-defined]
