"""gRPC servicer for ``specdec.v1.Draft``: thin validation and dispatch to the
session store and drafters. Several drafters are hosted at once (model
drafters on onnxruntime, different-tokenizer TLI drafters, model-free prompt
lookup) and chosen per session by name. All onnxruntime compute runs on the
model worker thread, off the event loop; prompt lookup (microseconds) runs
inline."""

from __future__ import annotations

import asyncio
import statistics
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import numpy as np

from draft_service.config import DrafterSpec, DraftServiceConfig
from draft_service.draft_kv import DraftKVCollector, KVBudget, PrefixCache, register_kv_metrics
from draft_service.drafter import Drafter, OnnxDrafter
from draft_service.session_stream import CatchUpTotals, SessionStream
from draft_service.sessions import CatchUp, ProposeResult, SessionStore, grammar_state
from specdec.errors import InvalidArgument, Unavailable
from specdec.grammar import LazyGrammarCompiler
from specdec.grpc_util import ModelWorker, ServerHandle, WorkTiming, drain, start_server, translate_errors
from specdec.logging_util import log
from specdec.memory import set_mmap_threshold
from specdec.metrics import ModelServiceMetrics, serve_metrics
from specdec.sampling import SamplingConfig
from specdec.session_ids import check_session_id
from specdec.validation import check_min_confidence
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

logger = logging.getLogger("specdec.draft")


@dataclass
class LoadedDrafter:
    """A hosted drafter and what GetModelInfo reports for it. ``vocab_size``
    and ``tokenizer_fingerprint`` describe the vocabulary its ids are in (the
    target's, for tli and prompt-lookup drafters)."""

    drafter: Drafter
    model_name: str
    precision: str
    tokenizer_fingerprint: str
    eos_token_ids: list[int] = field(default_factory=list)
    kind: str = "onnx"
    device: str = "cpu"
    max_context_tokens: int = 0
    intersection: int = 0  # tli: draft tokens whose bytes are target tokens
    token_ms: float = 0.0  # measured at warm-up: compute per drafted token of a 4-token round (0 = not measured)
    grammars: LazyGrammarCompiler | None = None  # structured output over the ids it proposes (None: no tokenizer)


@dataclass(frozen=True)
class TargetVocab:
    """The target vocabulary tli and prompt-lookup drafters propose in."""

    tokenizer: Any
    fingerprint: str
    vocab_size: int  # the target's logits size (config.json), else the tokenizer length
    eos_token_ids: list[int]
    max_context_tokens: int
    hf_dir: Path | None


def _timings(t: WorkTiming) -> common_pb2.Timings:
    return common_pb2.Timings(queue_ms=t.queue_ms, compute_ms=t.compute_ms)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """Answers UNAVAILABLE until the drafters are attached (still loading)."""

    def __init__(self, config: DraftServiceConfig, worker: ModelWorker, sessions: SessionStore) -> None:
        self.config = config
        self.worker = worker
        self.sessions = sessions
        self._drafters: dict[str, LoadedDrafter] = {}
        self.proposals: collections.Counter[str] = collections.Counter()  # Propose calls per drafter
        self.metrics = ModelServiceMetrics.create("draft")
        self.metrics.queue_depth.set_function(lambda: self.worker.pending)  # live at every scrape (HPA input)
        self.draining = False  # set on SIGTERM: no new sessions, existing ones are served
        self.metrics.active_sessions.set_function(lambda: len(self.sessions))  # exact at every scrape
        register_kv_metrics(self.metrics.registry, DraftKVCollector(
            sessions.usage, sessions.budget, lambda: sessions.prefixes, sessions.evictions))
        self._streams = SessionStream(sessions, worker, self.metrics, self._get, lambda: self.draining, self.proposals,
                                      config.prefill_chunk_tokens)

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
        d = self._get(request.drafter)
        return common_pb2.ModelInfo(
            drafter=d.drafter.name,
            model_name=d.model_name,
            vocab_size=d.drafter.vocab_size,
            eos_token_ids=d.eos_token_ids,
            max_context_tokens=d.max_context_tokens,
            dtype=d.precision,
            device=d.device,
            tokenizer_fingerprint=d.tokenizer_fingerprint,
            forward_cost=[common_pb2.CostPoint(tokens=1, ms=d.token_ms)] if d.token_ms > 0 else [],
            drafters=[self.config.default_name] + sorted(n for n in self._drafters if n != self.config.default_name),
        )

    @translate_errors
    async def CreateSession(
        self, request: draft_pb2.CreateDraftSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.CreateDraftSessionResponse:
        cfg = SamplingConfig.from_proto(request.sampling if request.HasField("sampling") else None)
        d = self._get(request.drafter)
        if request.session_id:
            check_session_id(request.session_id)
        if self.draining:
            raise Unavailable("the draft replica is shutting down; create the session on another replica")
        grammar = await grammar_state(d.grammars, d.drafter.name, request)
        # a caller that goes after this (its deadline racing the reply) is not
        # seen here: it releases the id it chose (docs/reliability.md)
        session = self.sessions.create(d.drafter, cfg, int(request.rng_offset), grammar=grammar,
                                       session_id=request.session_id)
        return draft_pb2.CreateDraftSessionResponse(session_id=session.id, drafter=d.drafter.name,
                                                    grammar_applied=grammar is not None)

    @translate_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        if not self._drafters:
            raise Unavailable("the draft models are still loading")
        session = self.sessions.get(request.session_id)  # NOT_FOUND early
        new_ids = list(request.new_token_ids)
        num_tokens = int(request.num_tokens)
        min_conf = check_min_confidence(request.min_confidence)
        # cheap checks on the loop; the store repeats them where it runs
        self.sessions.validate_propose(new_ids, num_tokens, session.drafter.vocab_size)
        args = (request.session_id, int(request.base_len), new_ids, num_tokens, min_conf)
        catch_up = CatchUpTotals()
        if session.drafter.inline:
            # a model-free drafter: microseconds, so no queueing behind model work
            started = time.perf_counter()
            out = self.sessions.propose(*args)
            timing = WorkTiming(0.0, (time.perf_counter() - started) * 1e3)
        else:
            # a long catch-up prefill runs a chunk per worker job, other sessions' calls between them;
            # a cancelled call (its deadline passed) stops at the next chunk, what was fed is kept
            while True:
                out, timing = await self.worker.run(self.sessions.propose, *args, self.config.prefill_chunk_tokens)
                if not isinstance(out, CatchUp):
                    break
                catch_up.add(out, timing)
        assert isinstance(out, ProposeResult)
        result = out
        timing = catch_up.total(timing)
        p = result.proposal
        self.proposals[session.drafter.name] += 1
        self.metrics.observe("propose", p.fed_tokens + catch_up.fed, timing.queue_ms, timing.compute_ms)
        self.metrics.queue_depth.set(self.worker.pending)
        return draft_pb2.ProposeResponse(
            token_ids=p.token_ids,
            probs=[
                common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=probs.tolist()) for ids, probs in p.q
            ],
            committed_len=result.committed_len,
            timings=_timings(timing),
            confidence=p.confidence,
            drafter=session.drafter.name,
            cached_prompt_tokens=p.cached_tokens + catch_up.cached,
        )

    async def Session(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftSessionEvent]:
        """One bidirectional draft stream per generation (draft_service/session_stream.py)."""
        async for event in self._streams.serve(request_iterator, context):
            yield event

    @translate_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        # Idempotent, like the target's: releasing an unknown, already released
        # or reaped session is OK with released=false (the store is a cache).
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        released = self.sessions.discard(request.session_id)
        return common_pb2.ReleaseResponse(released=released)


@dataclass
class DraftServer:
    handle: ServerHandle
    sessions: SessionStore
    drafters: dict[str, LoadedDrafter]
    worker: ModelWorker
    reaper: asyncio.Task[None]
    servicer: DraftServicer | None = None

    @property
    def port(self) -> int:
        return self.handle.port

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown, step one: new sessions are refused, the open ones
        are served until released (up to ``timeout_s``)."""
        if self.servicer is not None:
            self.servicer.draining = True
        await drain(self.handle, lambda: len(self.sessions), timeout_s, "draft")

    async def stop(self, grace: float | None = 5.0) -> None:
        self.reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reaper
        await self.handle.stop(grace)
        self.worker.shutdown()


def _budget(config: DraftServiceConfig) -> KVBudget:
    return KVBudget(config.kv_budget_tokens, config.kv_budget_bytes)


def _drafter_hf_dir(spec: DrafterSpec, cache_dir: Path) -> tuple[Path, str]:
    """(HF directory, model name) of a drafter spec: its local directory, or its model resolved."""
    local = Path(spec.model).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        return local.resolve(), local.name
    from specdec.models import resolve

    resolved = resolve(spec.model, cache_dir)
    return Path(resolved.hf_dir), resolved.name


def _config_eos_values(hf_dir: Path | None) -> list[object]:
    """The ``eos_token_id`` values of ``hf_dir``'s generation_config.json and config.json (those present)."""
    import json

    if hf_dir is None:
        return []
    files = (hf_dir / "generation_config.json", hf_dir / "config.json")
    return [json.loads(f.read_text()).get("eos_token_id") for f in files if f.is_file()]


def _local_hf_dir(spec: str) -> Path | None:
    local = Path(spec).expanduser()
    if local.is_dir() and ((local / "config.json").is_file() or (local / "tokenizer_config.json").is_file()):
        return local.resolve()
    return None


def load_target_vocab(config: DraftServiceConfig) -> TargetVocab | None:
    """Loads ``config.target_tokenizer`` (None when unset)."""
    import json

    from transformers import AutoTokenizer

    from specdec.tokenization import eos_token_ids, tokenizer_fingerprint

    if not config.target_tokenizer:
        return None
    hf_dir = _local_hf_dir(config.target_tokenizer)
    if hf_dir is None:
        from specdec.models import resolve

        hf_dir = Path(resolve(config.target_tokenizer, config.resolved_cache_dir()).hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab_size = len(tokenizer)
    context = 0
    cfg = hf_dir / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        vocab_size = int(c.get("vocab_size") or vocab_size)
        context = int(c.get("max_position_embeddings") or 0)
    eos = eos_token_ids(*_config_eos_values(hf_dir), tokenizer.eos_token_id)
    return TargetVocab(tokenizer, tokenizer_fingerprint(tokenizer), vocab_size, eos, context, hf_dir)


def _load_onnx_model(spec: DrafterSpec, config: DraftServiceConfig) -> tuple[Any, Path | None, str]:
    """(OnnxCausalLM, HF dir or None, model name) of a model drafter."""
    from draft_service.export import ensure_onnx
    from draft_service.onnx_model import OnnxCausalLM, resolve_execution

    cache_dir = config.resolved_cache_dir()
    execution = resolve_execution(config.execution)
    hf_dir: Path | None = None
    if spec.onnx_dir is not None:
        onnx_dir = Path(spec.onnx_dir)
        model_name = spec.name
        local = Path(spec.model).expanduser()
        if spec.model and local.is_dir() and (local / "config.json").is_file():
            hf_dir = local
    else:
        hf_dir, model_name = _drafter_hf_dir(spec, cache_dir)
        onnx_dir = ensure_onnx(hf_dir, cache_dir, spec.precision, execution)
    model = OnnxCausalLM(
        onnx_dir,
        execution=execution,
        intra_op_threads=config.intra_op_threads,
        spin=config.spin,
        max_cache_tokens=config.max_cache_tokens or None,
    )
    # one cache never holds more than the whole KV budget (on CUDA: the buffer preallocated per session)
    model.max_cache_tokens = min(model.max_cache_tokens, _budget(config).max_tokens(model.kv_bytes_per_token))
    return model, hf_dir, model_name


def _load_tokenizer(*dirs: Path | None) -> Any:
    from transformers import AutoTokenizer

    for d in dirs:
        if d is not None and (d / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(d))
    return None


def load_drafter(spec: DrafterSpec, config: DraftServiceConfig, target: TargetVocab | None = None) -> LoadedDrafter:
    """Resolves, exports (cached) and loads one drafter (blocking; off the loop)."""
    from specdec.tokenization import eos_token_ids, tokenizer_fingerprint

    if spec.kind == "prompt-lookup":
        from draft_service.prompt_lookup import PromptLookupDrafter

        if target is None:
            log(logger, logging.WARNING, "prompt-lookup without target_tokenizer: ids unchecked, no fingerprint",
                drafter=spec.name)
        vocab = target.vocab_size if target is not None else (1 << 31) - 1
        pl = PromptLookupDrafter(spec.name, vocab, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
        return LoadedDrafter(
            pl, "prompt-lookup", "", target.fingerprint if target else "",
            list(target.eos_token_ids) if target else [], kind=spec.kind, device="cpu",
            max_context_tokens=target.max_context_tokens if target else 0,
            grammars=LazyGrammarCompiler(target.tokenizer, target.vocab_size, target.eos_token_ids) if target else None,
        )
    model, hf_dir, model_name = _load_onnx_model(spec, config)
    tokenizer = _load_tokenizer(hf_dir, model.model_dir)
    if spec.kind == "tli":
        from draft_service.tli import TliDrafter, hf_tokenize_fn
        from draft_service.vocab_map import load_or_build_vocab_map

        if target is None:
            raise ValueError(f"drafter {spec.name!r} (tli) needs target_tokenizer")
        if tokenizer is None:
            raise ValueError(f"drafter {spec.name!r} (tli): no tokenizer next to the draft model")
        vm = load_or_build_vocab_map(
            tokenizer, target.tokenizer, model.vocab_size, target.vocab_size,
            draft_fingerprint=tokenizer_fingerprint(tokenizer), target_fingerprint=target.fingerprint,
            cache_dir=config.resolved_cache_dir(),
        )
        tli = TliDrafter(
            spec.name, model, vm, hf_tokenize_fn(tokenizer), target_vocab_size=target.vocab_size,
            max_support=config.max_support, lookbehind=spec.lookbehind_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
        )
        log(logger, logging.INFO, "tli vocabulary intersection", drafter=spec.name, intersection=vm.size,
            draft_vocab=model.vocab_size, target_vocab=target.vocab_size)
        return LoadedDrafter(
            tli, model_name, spec.precision, target.fingerprint, list(target.eos_token_ids), kind=spec.kind,
            device=model.device, max_context_tokens=model.max_cache_tokens, intersection=vm.size,
            grammars=LazyGrammarCompiler(target.tokenizer, target.vocab_size, target.eos_token_ids),
        )
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
    if not fingerprint:
        log(logger, logging.WARNING, "no tokenizer found; fingerprint left empty", drafter=spec.name)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    eos = eos_token_ids(*_config_eos_values(hf_dir), tokenizer_eos, model.eos_token_ids)
    drafter = OnnxDrafter(spec.name, model, max_support=config.max_support, eos_token_ids=eos,
                          prefill_chunk_tokens=config.prefill_chunk_tokens)
    return LoadedDrafter(
        drafter, model_name, spec.precision, fingerprint, eos, kind=spec.kind, device=model.device,
        max_context_tokens=model.max_cache_tokens,
        grammars=LazyGrammarCompiler(tokenizer, model.vocab_size, eos) if tokenizer is not None else None,
    )


def load_auto_drafter(spec: DrafterSpec, fallback: LoadedDrafter) -> LoadedDrafter:
    """An ``auto`` drafter over a loaded model drafter (reports its vocabulary)."""
    from draft_service.prompt_lookup import AutoDrafter, PromptLookupDrafter

    vocab = fallback.drafter.vocab_size
    lookup = PromptLookupDrafter(spec.name, vocab, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
    auto = AutoDrafter(spec.name, lookup, fallback.drafter)
    return LoadedDrafter(
        auto, f"auto(prompt-lookup, {fallback.model_name})", fallback.precision, fallback.tokenizer_fingerprint,
        list(fallback.eos_token_ids), kind=spec.kind, device=fallback.device,
        max_context_tokens=fallback.max_context_tokens, intersection=fallback.intersection,
        grammars=fallback.grammars,
    )


def warmup(drafter: Drafter) -> None:
    """One short propose per sampling mode (graph optimisation, allocations)."""
    state = drafter.new_state()
    rng = np.random.default_rng(0)
    ids = [i % drafter.vocab_size for i in range(5)]
    inter = getattr(drafter, "inter_target", None)
    if inter is not None:  # tli: ids with text, so the draft context is not empty
        ids = [int(x) for x in inter[-5:]]
    drafter.propose(state, ids[:4], 2, SamplingConfig(), rng)
    drafter.propose(state, ids, 2, SamplingConfig(temperature=1.0), rng)


def measure_token_ms(drafter: Drafter, rounds: int = 3, gamma: int = 4) -> float:
    """Compute per drafted token of a typical round (roll back, feed one
    committed token, draft ``gamma``), median of ``rounds``: the prior of the
    orchestrator's draft cost model (ModelInfo.forward_cost)."""
    state = drafter.new_state()
    rng = np.random.default_rng(0)
    committed = [i % drafter.vocab_size for i in range(1, 9)]
    inter = getattr(drafter, "inter_target", None)
    if inter is not None:
        committed = [int(x) for x in inter[-8:]]
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        prop = drafter.propose(state, committed, gamma, SamplingConfig(), rng)
        times.append((time.perf_counter() - t0) * 1000.0 / gamma)
        committed = committed + [int(prop.token_ids[0]) if len(prop.token_ids) else committed[0]]
    return round(statistics.median(times[1:]), 3)


async def _reap(sessions: SessionStore, ttl_s: float) -> None:
    while True:
        await asyncio.sleep(max(0.5, min(ttl_s / 4, 30.0)))
        try:
            sessions.reap()
        except Exception as e:  # the reaper outlives any one failure (as the target's)
            log(logger, logging.ERROR, "idle-session reaper failed; retrying next period", error=repr(e))


async def start(config: DraftServiceConfig) -> DraftServer:
    """Binds the port (health NOT_SERVING), loads/exports and warms every
    drafter off the event loop, then flips health to SERVING."""
    config.validate()
    set_mmap_threshold(config.memory_mmap_threshold_bytes)  # before the models' buffers are allocated
    worker = ModelWorker("draft-model", max_queue=config.max_queue)
    sessions = SessionStore(
        config.max_sessions, config.session_ttl_s, config.max_span, budget=_budget(config),
        protect_active_s=config.kv_protect_active_s,
        prefixes=PrefixCache(config.prefix_cache_entries) if config.prefix_cache else None,
    )
    servicer = DraftServicer(config, worker, sessions)
    handle = await start_server(
        lambda server: draft_pb2_grpc.add_DraftServicer_to_server(servicer, server),
        [draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name],
        config.host,
        config.port,
        config.max_message_bytes,
        health_port=config.health_port,
        tls=config.tls,
    )
    log(logger, logging.INFO, "draft service listening (loading drafters)", port=handle.port)
    drafters: dict[str, LoadedDrafter] = {}
    try:
        target = None
        if any(d.kind in ("tli", "prompt-lookup") for d in config.drafters):
            target, _ = await worker.run(load_target_vocab, config)
        # auto drafters wrap a model drafter: load them last
        for spec in sorted(config.drafters, key=lambda d: d.kind == "auto"):
            if spec.kind == "auto":
                loaded, t = await worker.run(load_auto_drafter, spec, drafters[spec.fallback])
                # its cost prior is its fallback's: what a round costs when prompt lookup has
                # nothing. Without one the orchestrator assumed 20 ms a token, and on a target
                # of ~60 ms a step that kept a fresh stack's AUTO from drafting with it at all
                loaded.token_ms = drafters[spec.fallback].token_ms
                drafters[spec.name] = loaded
                log(logger, logging.INFO, "drafter ready", drafter=spec.name, kind=spec.kind, fallback=spec.fallback)
                continue
            loaded, t = await worker.run(load_drafter, spec, config, target)
            if config.warmup:
                await worker.run(warmup, loaded.drafter)
                loaded.token_ms, _ = await worker.run(measure_token_ms, loaded.drafter)
            log(
                logger,
                logging.INFO,
                "drafter ready",
                drafter=spec.name,
                kind=spec.kind,
                model=loaded.model_name,
                precision=spec.precision,
                vocab_size=loaded.drafter.vocab_size,
                intersection=loaded.intersection or None,
                load_ms=round(t.compute_ms),
                token_ms=loaded.token_ms,
            )
            drafters[spec.name] = loaded
    except BaseException:
        await handle.stop(0)
        worker.shutdown()
        raise
    servicer.attach(drafters)
    reaper = asyncio.create_task(_reap(sessions, config.session_ttl_s))
    serve_metrics(servicer.metrics.registry, config.metrics_port, config.metrics_host)
    await handle.set_serving(True)
    log(logger, logging.INFO, "draft service ready", port=handle.port, drafters=list(drafters))
    return DraftServer(handle, sessions, drafters, worker, reaper, servicer)
