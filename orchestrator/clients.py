"""gRPC implementations of the decode loop's ``TargetClient`` and ``DraftClient``."""

from __future__ import annotations

from typing import Any, Sequence

import grpc
import numpy as np

from orchestrator.decode import PrefillReply, ProposeReply, SparseQ, VerifyReply
from specdec.errors import from_rpc_error
from specdec.grpc_util import channel_options
from specdec.tls import TlsClientConfig, aio_channel
from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def sampling_proto(cfg: SamplingConfig) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    if cfg.seed is not None:
        msg.seed = cfg.seed
    return msg


def make_channel(address: str, max_message_bytes: int, tls: TlsClientConfig | None = None) -> grpc.aio.Channel:
    return aio_channel(address, tls, channel_options(max_message_bytes))


class _GrpcClient:
    """Calls one service and maps its RpcErrors onto domain errors."""

    service = ""

    def __init__(self, stub: Any) -> None:
        self.stub = stub

    async def _rpc(self, method: str, request: Any, timeout: float | None) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.service) from None

    async def info(self, timeout: float | None = None, drafter: str = "") -> common_pb2.ModelInfo:
        return await self._rpc("GetModelInfo", common_pb2.ModelInfoRequest(drafter=drafter), timeout)

    async def release(self, session_id: str, timeout: float | None) -> None:
        await self._rpc("Release", common_pb2.ReleaseRequest(session_id=session_id), timeout)


class GrpcTargetClient(_GrpcClient):
    service = "target"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(target_pb2_grpc.TargetStub(channel))

    async def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int, timeout: float | None
    ) -> PrefillReply:
        req = target_pb2.PrefillRequest(
            token_ids=token_ids, sampling=sampling_proto(cfg), sample_next_token=sample_next, rng_offset=rng_offset
        )
        r = await self._rpc("Prefill", req, timeout)
        return PrefillReply(
            r.session_id,
            r.next_token_id if r.has_next_token else None,
            r.next_token_logit_gap,
            r.cache_len,
            r.timings.compute_ms,
        )

    async def verify(
        self,
        session_id: str,
        cache_len: int,
        new_ids: Sequence[int],
        draft_ids: Sequence[int],
        q: Sequence[SparseQ],
        timeout: float | None,
    ) -> VerifyReply:
        req = target_pb2.VerifyRequest(
            session_id=session_id,
            cache_len=cache_len,
            new_token_ids=new_ids,
            draft_token_ids=draft_ids,
            draft_probs=[common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=p.tolist()) for ids, p in q],
        )
        r = await self._rpc("Verify", req, timeout)
        return VerifyReply(
            r.num_accepted,
            r.next_token_id,
            r.cache_len,
            list(r.logit_gaps),
            r.timings.compute_ms,
            r.timings.queue_ms,
            r.queue_depth,
            r.timings.batch_size or 1,
            r.timings.batch_tokens,
        )



class GrpcDraftClient(_GrpcClient):
    service = "draft"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(draft_pb2_grpc.DraftStub(channel))

    async def create(self, cfg: SamplingConfig, drafter: str, timeout: float | None, rng_offset: int = 0) -> str:
        req = draft_pb2.CreateDraftSessionRequest(sampling=sampling_proto(cfg), drafter=drafter, rng_offset=rng_offset)
        r = await self._rpc("CreateSession", req, timeout)
        return r.session_id

    async def propose(
        self,
        session_id: str,
        base_len: int,
        new_ids: Sequence[int],
        num_tokens: int,
        min_confidence: float,
        timeout: float | None,
    ) -> ProposeReply:
        req = draft_pb2.ProposeRequest(
            session_id=session_id,
            base_len=base_len,
            new_token_ids=new_ids,
            num_tokens=num_tokens,
            min_confidence=min_confidence,
        )
        r = await self._rpc("Propose", req, timeout)
        q = [
            (np.asarray(d.token_ids, dtype=np.int64), np.asarray(d.probs, dtype=np.float32)) for d in r.probs
        ]
        return ProposeReply(list(r.token_ids), q, r.committed_len, r.timings.compute_ms, list(r.confidence))



class GrpcEndpoint:
    """One replica for ``orchestrator.routing``: its channel, client and health check."""

    def __init__(self, channel: grpc.aio.Channel, client: Any) -> None:
        self.channel = channel
        self.client = client

    async def check(self, timeout: float) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self.channel.close()
