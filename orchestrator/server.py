"""Start-up and lifecycle of the orchestrator: the routers over the target
and draft replicas, the gRPC server and its guard, waiting for the
services, attaching the draft once it answers, the speculation load gate,
and graceful drain and stop. The servicer is in orchestrator/servicer.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from orchestrator.clients import GrpcDraftClient, GrpcEndpoint, GrpcTargetClient, make_channel
from orchestrator.config import OrchestratorConfig
from orchestrator.routing import ReplicaPool, RoutedDraft, RoutedTarget, Router
from orchestrator.servicer import ModelLimits, OrchestratorServicer
from orchestrator.telemetry import RoutingMetrics
from specdec.auth import ServerGuard, TokenStore
from specdec.errors import SpecdecError, Unavailable
from specdec.grpc_util import ServerHandle, drain, start_server
from specdec.logging_util import log
from specdec.metrics import OrchestratorMetrics, serve_metrics
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

logger = logging.getLogger("specdec.orchestrator")


def speculation_stream_limit(configured: int, target_device: str) -> int:
    """The AUTO load gate: ``configured`` when set (≥ 0), else 1 for a CPU
    target and unlimited (0) on accelerators. On a CPU target draft and
    target share the cores and batching already fills them at two streams:
    on the reference machine speculation at two streams measured between
    0.74× and 1.15× of plain decoding (docs/benchmarks.md, "Load"), so by
    default it runs only while one stream is active."""
    if configured >= 0:
        return configured
    return 1 if target_device.startswith("cpu") else 0


@dataclass
class OrchestratorServer:
    handle: ServerHandle
    servicer: OrchestratorServicer
    routers: list[Router[Any]]
    tasks: list[asyncio.Task[None]]
    guard: ServerGuard | None = None

    def reload(self) -> None:
        """Re-reads the auth tokens file (SIGHUP)."""
        if self.guard is not None and self.guard.tokens is not None:
            self.guard.tokens.reload()

    @property
    def port(self) -> int:
        return self.handle.port

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown, step one: health NOT_SERVING, new streams refused,
        running streams finish (up to ``timeout_s``)."""
        self.servicer.draining = True
        await drain(self.handle, lambda: self.servicer.active, timeout_s, "orchestrator")

    async def stop(self, grace: float | None = 5.0) -> None:
        for t in self.tasks:
            t.cancel()
        await self.handle.stop(grace)
        for r in self.routers:
            await r.close()


def load_tokenizer(spec: str, cache_dir: Path | None) -> Any:
    from transformers import AutoTokenizer

    from specdec.models import default_cache_dir, resolve

    resolved = resolve(spec, Path(cache_dir or default_cache_dir()))
    return AutoTokenizer.from_pretrained(str(resolved.hf_dir))


async def target_numerics(client: GrpcTargetClient) -> str:
    """A target replica's numerics as routing compares them: "dtype/backend"
    from its ModelInfo (what calibration chose on that node)."""
    info = await client.info(timeout=5.0)
    return f"{info.dtype}/{info.backend}" if info.dtype or info.backend else ""


async def _wait_info(client: Any, name: str, timeout_s: float) -> Any:
    """Polls GetModelInfo until the service answers (it is UNAVAILABLE while loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.info(timeout=5.0)
        except SpecdecError as e:
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} service did not become ready: {e.message}") from None
            await asyncio.sleep(0.5)


async def _attach_draft(
    servicer: OrchestratorServicer, draft: Router[GrpcDraftClient], target_info: Any, timeout_s: float
) -> None:
    """Enables speculation once the draft service answers with a compatible
    tokenizer; until then requests run target-only."""
    try:
        dinfo = await _wait_info(draft, "draft", timeout_s)
    except Unavailable as e:
        log(logger, logging.WARNING, "draft service never became ready; serving target-only", error=e.message)
        return
    default = dinfo.drafter or dinfo.model_name
    infos = {default: dinfo}
    for name in dinfo.drafters:  # every hosted drafter, not only the default
        if name and name not in infos:
            try:
                infos[name] = await draft.info(timeout=10.0, drafter=name)
            except SpecdecError as e:
                servicer.refused_drafters[name] = f"its model info could not be read: {e.message}"
    costs: dict[str, float] = {}
    for name, info in infos.items():
        why = drafter_mismatch(info, target_info)
        if why:
            servicer.refused_drafters[name] = why
            log(logger, logging.ERROR, "drafter refused", drafter=name, reason=why)
        elif info.forward_cost:
            costs[name] = info.forward_cost[0].ms
    if default in servicer.refused_drafters:
        log(logger, logging.WARNING, "the draft service's default drafter is refused; speculation disabled",
            drafter=default, reason=servicer.refused_drafters[default])
        return
    servicer.draft = draft
    servicer.draft_device = dinfo.device
    servicer.default_drafter = default
    servicer.hosted_drafters = frozenset(infos)
    servicer.policies.set_cost_priors(draft_token_ms=costs)
    log(logger, logging.INFO, "draft service attached", draft=dinfo.model_name, drafters=sorted(infos),
        refused=sorted(servicer.refused_drafters) or None, draft_token_ms=costs or None)


def drafter_mismatch(info: Any, target_info: Any) -> str:
    """Why a drafter cannot speculate for this target ("" = it can): it must
    propose in the target's vocabulary, with the target's tokenizer."""
    if info.tokenizer_fingerprint and info.tokenizer_fingerprint != target_info.tokenizer_fingerprint:
        return "its tokenizer fingerprint differs from the target's (it would propose ids of another vocabulary)"
    if info.vocab_size > target_info.vocab_size:
        return f"its vocabulary ({info.vocab_size}) is larger than the target's ({target_info.vocab_size})"
    return ""


async def start(config: OrchestratorConfig, ready_timeout_s: float = 1800.0) -> OrchestratorServer:
    """Starts the public API; health turns SERVING once the tokenizer is loaded
    and the target answers. A draft that is absent or has another tokenizer
    leaves the service running target-only (logged)."""
    plaintext_tokens = config.check_token_transport()  # ValueError before anything starts
    if plaintext_tokens:
        log(logger, logging.WARNING, plaintext_tokens, host=config.host)
    metrics = OrchestratorMetrics.create()
    events = RoutingMetrics(metrics)

    def endpoint(client_cls: Any) -> Any:
        def connect(address: str) -> GrpcEndpoint:
            ch = make_channel(address, config.max_message_bytes, config.upstream_tls)
            return GrpcEndpoint(ch, client_cls(ch))

        return connect

    target: Router[GrpcTargetClient] = Router(
        ReplicaPool("target", list(config.target_addresses),
                    endpoint(lambda ch: GrpcTargetClient(ch, verify_stream=config.target_verify_stream)),
                    config.routing, events, numerics_of=target_numerics),
        RoutedTarget,
    )
    routers: list[Router[Any]] = [target]
    draft: Router[GrpcDraftClient] | None = None
    if config.draft_addresses:
        draft = Router(
            ReplicaPool("draft", list(config.draft_addresses),
                        endpoint(lambda ch: GrpcDraftClient(ch, batch_events=config.draft_batch_events)),
                        config.routing, events),
            RoutedDraft,
        )
        routers.append(draft)
    for r in routers:
        await r.start()
    holder: dict[str, OrchestratorServicer] = {}
    guard = ServerGuard(
        TokenStore(config.auth_tokens_file) if config.auth_tokens_file is not None else None,
        protect_health=config.auth_protect_health,
        max_calls_per_client=config.max_streams_per_client,
        log_to=logger,
    )

    class _Servicer(orchestrator_pb2_grpc.OrchestratorServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]
            real = holder.get("s")
            if real is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the orchestrator is starting")
            async for chunk in real.Generate(request, context):  # type: ignore[union-attr]
                yield chunk

    handle = await start_server(
        lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_Servicer(), server),
        [pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name],
        config.host,
        config.port,
        config.max_message_bytes,
        health_port=config.health_port,
        tls=config.tls,
        guard=guard,
    )
    log(logger, logging.INFO, "orchestrator listening (waiting for services)", port=handle.port)
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer, config.cache_dir)
        from specdec.tokenization import tokenizer_fingerprint

        fingerprint = tokenizer_fingerprint(tokenizer)
        info = await _wait_info(target, "target", ready_timeout_s)
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != fingerprint:
            raise RuntimeError("the orchestrator's tokenizer differs from the target model's tokenizer")
    except BaseException:
        await handle.stop(0)
        for r in routers:
            await r.close()
        raise
    limits = ModelLimits(info.vocab_size, frozenset(info.eos_token_ids), info.max_context_tokens)
    servicer = OrchestratorServicer(config, tokenizer, target, None, limits, metrics)
    servicer.identify = guard.identify
    guard.on_reject = servicer.on_rejected
    servicer.target_device = info.device
    servicer.set_speculation_limit(speculation_stream_limit(config.speculation_max_streams, info.device))
    # the target's measured t(k) starts every cost model (live rounds replace it)
    servicer.policies.set_cost_priors(verify_curve={p.tokens: p.ms for p in info.forward_cost})
    servicer.metrics_port = serve_metrics(servicer.metrics.registry, config.metrics_port, config.metrics_host)
    holder["s"] = servicer
    tasks = []
    if draft is not None:
        tasks.append(asyncio.create_task(_attach_draft(servicer, draft, info, ready_timeout_s)))
    await handle.set_serving(True)
    log(logger, logging.INFO, "orchestrator ready", port=handle.port, target=info.model_name,
        target_dtype=info.dtype, target_backend=info.backend,
        target_forward_ms={p.tokens: round(p.ms, 1) for p in info.forward_cost})
    return OrchestratorServer(handle, servicer, routers, tasks, guard)
