"""gRPC servicer for ``specdec.v1.Draft``: thin validation and dispatch to the
session store and drafters; all onnxruntime compute runs on the model worker
thread, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from draft_service.config import DrafterSpec, DraftServiceConfig
from draft_service.drafter import OnnxDrafter
from draft_service.sessions import SessionStore
from specdec.errors import InvalidArgument, Unavailable
from specdec.grpc_util import ModelWorker, ServerHandle, WorkTiming, start_server, translate_errors
from specdec.logging_util import log
from specdec.sampling import SamplingConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger("specdec.draft")


@dataclass
class LoadedDrafter:
    drafter: OnnxDrafter
    model_name: str
    precision: str
    tokenizer_fingerprint: str
    eos_token_ids: list[int] = field(default_factory=list)


def _timings(t: WorkTiming) -> common_pb2.Timings:
    return common_pb2.Timings(queue_ms=t.queue_ms, compute_ms=t.compute_ms)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """Answers UNAVAILABLE until the drafters are attached (still loading)."""

    def __init__(self, config: DraftServiceConfig, worker: ModelWorker, sessions: SessionStore) -> None:
        self.config = config
        self.worker = worker
        self.sessions = sessions
        self._drafters: dict[str, LoadedDrafter] = {}

    def attach(self, drafters: dict[str, LoadedDrafter]) -> None:
        self._drafters = drafters

    def _get(self, name: str) -> LoadedDrafter:
        if not self._drafters:
            raise Unavailable("the draft models are still loading")
        key = name or self.config.default_name
        loaded = self._drafters.get(key)
        if loaded is None:
            raise InvalidArgument(f"unknown drafter {key!r}; available: {sorted(self._drafters)}")
        return loaded

    @translate_errors
    async def GetModelInfo(
        self, request: common_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        d = self._get("")
        return common_pb2.ModelInfo(
            model_name=d.model_name,
            vocab_size=d.drafter.vocab_size,
            eos_token_ids=d.eos_token_ids,
            max_context_tokens=d.drafter.max_context_tokens,
            dtype=d.precision,
            device=d.drafter.model.device,
            tokenizer_fingerprint=d.tokenizer_fingerprint,
        )

    @translate_errors
    async def CreateSession(
        self, request: draft_pb2.CreateDraftSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.CreateDraftSessionResponse:
        cfg = SamplingConfig.from_proto(request.sampling if request.HasField("sampling") else None)
        d = self._get(request.drafter)
        session = self.sessions.create(d.drafter, cfg)
        return draft_pb2.CreateDraftSessionResponse(session_id=session.id, drafter=d.drafter.name)

    @translate_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        if not self._drafters:
            raise Unavailable("the draft models are still loading")
        session = self.sessions.get(request.session_id)  # NOT_FOUND early
        new_ids = list(request.new_token_ids)
        num_tokens = int(request.num_tokens)
        # cheap checks on the loop; the store repeats them on the worker
        self.sessions.validate_propose(new_ids, num_tokens, session.drafter.vocab_size)
        result, timing = await self.worker.run(
            self.sessions.propose, request.session_id, int(request.base_len), new_ids, num_tokens
        )
        p = result.proposal
        return draft_pb2.ProposeResponse(
            token_ids=p.token_ids,
            probs=[
                common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=probs.tolist()) for ids, probs in p.q
            ],
            committed_len=result.committed_len,
            timings=_timings(timing),
        )

    @translate_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        self.sessions.release(request.session_id)
        return common_pb2.ReleaseResponse(released=True)


@dataclass
class DraftServer:
    handle: ServerHandle
    sessions: SessionStore
    drafters: dict[str, LoadedDrafter]
    worker: ModelWorker
    reaper: asyncio.Task[None]

    @property
    def port(self) -> int:
        return self.handle.port

    async def stop(self, grace: float | None = 5.0) -> None:
        self.reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reaper
        await self.handle.stop(grace)
        self.worker.shutdown()


def _hf_dir_for(spec: DrafterSpec, cache_dir: Path) -> tuple[Path, str]:
    """(HF directory, model name) of a drafter spec."""
    local = Path(spec.model).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        return local.resolve(), local.name
    from specdec.models import resolve

    resolved = resolve(spec.model, cache_dir)
    return Path(resolved.hf_dir), resolved.name


def _eos_ids(hf_dir: Path | None, tokenizer: object | None, fallback: list[int]) -> list[int]:
    import json

    ids: list[int] = []
    if hf_dir is not None:
        for fname in ("generation_config.json", "config.json"):
            f = hf_dir / fname
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                ids += [eos] if isinstance(eos, int) else list(eos or [])
    tid = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tid, int):
        ids.append(tid)
    ids += fallback
    return sorted(set(int(i) for i in ids))


def load_drafter(spec: DrafterSpec, config: DraftServiceConfig) -> LoadedDrafter:
    """Resolves, exports (cached) and loads one drafter (blocking; off the loop)."""
    from transformers import AutoTokenizer

    from draft_service.export import ensure_onnx
    from draft_service.onnx_model import OnnxCausalLM, resolve_execution
    from specdec.tokenization import tokenizer_fingerprint

    cache_dir = config.resolved_cache_dir()
    execution = resolve_execution(config.execution)
    hf_dir: Path | None = None
    if spec.onnx_dir is not None:
        onnx_dir = Path(spec.onnx_dir)
        model_name = spec.name
        local = Path(spec.model).expanduser()
        if local.is_dir() and (local / "config.json").is_file():
            hf_dir = local
    else:
        hf_dir, model_name = _hf_dir_for(spec, cache_dir)
        onnx_dir = ensure_onnx(hf_dir, cache_dir, spec.precision, execution)
    model = OnnxCausalLM(
        onnx_dir,
        execution=execution,
        intra_op_threads=config.intra_op_threads,
        allow_spinning=config.allow_spinning,
        max_cache_tokens=config.max_cache_tokens or None,
    )
    tokenizer = None
    fingerprint = ""
    for d in (hf_dir, onnx_dir):
        if d is not None and (d / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(d))
            fingerprint = tokenizer_fingerprint(tokenizer)
            break
    if not fingerprint:
        log(logger, logging.WARNING, "no tokenizer found; fingerprint left empty", drafter=spec.name)
    eos = _eos_ids(hf_dir, tokenizer, model.eos_token_ids)
    drafter = OnnxDrafter(spec.name, model, max_support=config.max_support, eos_token_ids=eos)
    return LoadedDrafter(drafter, model_name, spec.precision, fingerprint, eos)


def warmup(drafter: OnnxDrafter) -> None:
    """One short propose per sampling mode (graph optimisation, allocations)."""
    state = drafter.new_state()
    rng = np.random.default_rng(0)
    ids = [i % drafter.vocab_size for i in range(5)]
    drafter.propose(state, ids[:4], 2, SamplingConfig(), rng)
    drafter.propose(state, ids, 2, SamplingConfig(temperature=1.0), rng)


async def _reap(sessions: SessionStore, ttl_s: float) -> None:
    while True:
        await asyncio.sleep(max(0.5, min(ttl_s / 4, 30.0)))
        sessions.reap()


async def start(config: DraftServiceConfig) -> DraftServer:
    """Binds the port (health NOT_SERVING), loads/exports and warms every
    drafter off the event loop, then flips health to SERVING."""
    config.validate()
    worker = ModelWorker("draft-model", max_queue=config.max_queue)
    sessions = SessionStore(config.max_sessions, config.session_ttl_s, config.max_span)
    servicer = DraftServicer(config, worker, sessions)
    handle = await start_server(
        lambda server: draft_pb2_grpc.add_DraftServicer_to_server(servicer, server),
        [draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name],
        config.host,
        config.port,
        config.max_message_bytes,
    )
    log(logger, logging.INFO, "draft service listening (loading drafters)", port=handle.port)
    drafters: dict[str, LoadedDrafter] = {}
    try:
        for spec in config.drafters:
            loaded, t = await worker.run(load_drafter, spec, config)
            if config.warmup:
                await worker.run(warmup, loaded.drafter)
            log(
                logger,
                logging.INFO,
                "drafter ready",
                drafter=spec.name,
                model=loaded.model_name,
                precision=spec.precision,
                load_ms=round(t.compute_ms),
            )
            drafters[spec.name] = loaded
    except BaseException:
        await handle.stop(0)
        worker.shutdown()
        raise
    servicer.attach(drafters)
    reaper = asyncio.create_task(_reap(sessions, config.session_ttl_s))
    await handle.set_serving(True)
    log(logger, logging.INFO, "draft service ready", port=handle.port, drafters=list(drafters))
    return DraftServer(handle, sessions, drafters, worker, reaper)
