"""Prometheus wiring of the orchestrator: ``MetricsSink`` takes every
verified round (and fallbacks, rebuilds) from the decode loop, feeding the
metrics and the policies' shared statistics; ``RoutingMetrics`` turns the
replica pools' routing events into per-replica series.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from orchestrator.policy import PolicyFactory, RoundObservation
from orchestrator.routing import Replica
from specdec.logging_util import log
from specdec.metrics import OrchestratorMetrics

logger = logging.getLogger("specdec.orchestrator.rounds")


class MetricsSink:
    """The per-round stats path: every RoundObservation feeds Prometheus and
    the shared acceptance/cost statistics the adaptive policy starts from
    (the request's own policy gets the same object in ``Decoder``)."""

    def __init__(self, m: OrchestratorMetrics, policies: PolicyFactory) -> None:
        self.m = m
        self.policies = policies

    def on_round(self, obs: RoundObservation, drafter: str) -> None:
        self.policies.observe(obs, drafter)
        if logger.isEnabledFor(logging.DEBUG):  # --log-level debug: one line per verified round
            log(logger, logging.DEBUG, "round", drafter=drafter, **dataclasses.asdict(obs))
        m = self.m
        m.rounds.inc()
        m.verify_time.observe(obs.verify_compute_ms / 1e3)
        m.round_trip_time.labels("target").observe(max(0.0, obs.verify_ms - obs.verify_compute_ms - obs.verify_queue_ms) / 1e3)
        m.round_time.observe((obs.draft_ms + obs.verify_ms) / 1e3)
        if obs.gamma > 0:
            m.num_drafts.labels(drafter).inc()
            m.num_draft_tokens.labels(drafter).inc(obs.gamma)
            m.num_accepted_tokens.labels(drafter).inc(obs.accepted)
            if obs.requested > obs.gamma:
                m.num_draft_tokens_stopped.labels(drafter).inc(obs.requested - obs.gamma)
            for i in range(obs.accepted):
                m.accepted_per_pos.labels(drafter, str(i)).inc()
            m.draft_time.observe(obs.draft_compute_ms / 1e3)
            m.round_trip_time.labels("draft").observe(max(0.0, obs.draft_ms - obs.draft_compute_ms) / 1e3)

    def on_fallback(self) -> None:
        self.m.draft_failures.inc()

    def on_rebuild(self) -> None:
        self.m.target_rebuilds.inc()


class RoutingMetrics:
    """Routing events → per-replica Prometheus series (removed with the replica)."""

    def __init__(self, m: OrchestratorMetrics) -> None:
        self.m = m

    def _created(self, service: str) -> Any:
        return self.m.target_sessions_created if service == "target" else self.m.draft_sessions_created

    def replica_added(self, service: str, replica: Replica[Any]) -> None:
        self.m.upstream_sessions.labels(service, replica.address).set_function(lambda: replica.sessions)
        self._created(service).labels(replica.address)

    def replica_removed(self, service: str, address: str) -> None:
        for metric, labels in ((self.m.upstream_sessions, (service, address)), (self._created(service), (address,)),
                               (self.m.upstream_failures, (service, address))):
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def replicas_changed(self, service: str, available: int, unavailable: int) -> None:
        self.m.upstream_replicas.labels(service, "available").set(available)
        self.m.upstream_replicas.labels(service, "unavailable").set(unavailable)

    def session_created(self, service: str, address: str) -> None:
        self._created(service).labels(address).inc()

    def replica_failed(self, service: str, address: str, error: str) -> None:
        self.m.upstream_failures.labels(service, address).inc()
