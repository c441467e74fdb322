"""gRPC servicer for ``specdec.v1.Target``: thin validation and dispatch to
:class:`target_service.engine.TargetEngine` on the model worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import numpy as np

from specdec.errors import InvalidArgument, Unavailable
from specdec.grammar import GrammarSpec, GrammarState, LazyGrammarCompiler
from specdec.grpc_util import ServerHandle, WorkTiming, abort_with, drain, start_server, translate_errors
from specdec.logging_util import log
from specdec.memory import set_mmap_threshold
from specdec.metrics import BatchMetrics, KVMetrics, ModelServiceMetrics, export_calibration, serve_metrics
from specdec.sampling import MAX_TOP_LOGPROBS, SamplingConfig, SparseQ, TokenLogprob
from specdec.session_ids import check_session_id
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.batching import BatchReport, BatchScheduler
from target_service.config import TargetServiceConfig
from target_service.backends import cpu_info
from target_service.calibration import CalibrationResult, calibrate
from target_service import checks
from target_service.calls import PrefillCall, PrefillOutcome, VerifyCall, VerifyOutcome
from target_service.engine import TargetEngine
from target_service.loading import pick_device, set_threads

logger = logging.getLogger("specdec.target")

#: VerifyRequest.decode_ahead is capped here: at most this many steps are run
#: for a caller that may stop reading (its stop strings, a cancel)
MAX_DECODE_AHEAD = 64


def _timings(t: WorkTiming) -> common_pb2.Timings:
    return common_pb2.Timings(
        queue_ms=t.queue_ms, compute_ms=t.compute_ms, batch_size=t.batch_size, batch_tokens=t.batch_tokens
    )


def _cost_points(curve: dict[int, float]) -> list[common_pb2.CostPoint]:
    return [common_pb2.CostPoint(tokens=k, ms=ms) for k, ms in sorted(curve.items())]


def _fidelity(f: dict[str, object] | None) -> common_pb2.Fidelity | None:
    if not f:
        return None
    return common_pb2.Fidelity(positions=int(f["positions"]), mean_kl=float(f["mean_kl"]),  # type: ignore[arg-type]
                               p99_kl=float(f["p99_kl"]), max_kl=float(f["max_kl"]),  # type: ignore[arg-type]
                               top1_agreement=float(f["top1_agreement"]), corpus=str(f.get("corpus", "")))  # type: ignore[arg-type]


def _sparse_q(msgs: object) -> list[SparseQ | None]:
    return [
        (np.asarray(m.token_ids, dtype=np.int64), np.asarray(m.probs, dtype=np.float32))  # type: ignore[attr-defined]
        for m in msgs  # type: ignore[attr-defined]
    ]


def _logprobs(lps: list[TokenLogprob]) -> list[common_pb2.TokenLogprobs]:
    return [
        common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
            top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps
    ]


def _post(request: target_pb2.VerifyRequest) -> tuple[int | None, SparseQ | None]:
    """The post-verify token and its q: (None, None) without ``has_post_token``;
    an empty ``post_prob`` (no token_ids, no probs) is one-hot q (None); a
    half-filled one is passed on for the engine's q checks to refuse."""
    if not request.has_post_token:
        return None, None
    m = request.post_prob
    q = _sparse_q([m])[0] if (m.token_ids or m.probs) else None
    return int(request.post_token_id), q


class TargetServicer(target_pb2_grpc.TargetServicer):
    """Answers UNAVAILABLE until ``engine`` is set (the model is loading).
    Prefill and Verify go through the batch scheduler; other model jobs run
    exclusively on its thread."""

    def __init__(self, worker: BatchScheduler) -> None:
        self.worker = worker
        self.metrics = ModelServiceMetrics.create("target")
        self.metrics.queue_depth.set_function(lambda: self.worker.pending)  # live at every scrape (HPA input)
        self.batch_metrics = BatchMetrics.create(self.metrics.registry)
        self.kv_metrics = KVMetrics.create(self.metrics.registry, "target")
        self._engine: TargetEngine | None = None
        self.calibration: CalibrationResult | None = None
        self.fingerprint = ""
        self._evictions_seen = 0
        self.draining = False  # set on SIGTERM: no new sessions, existing ones are served
        self.verify_streams = 0  # VerifyStream calls opened (each serves one session's rounds)
        self.ahead_steps = 0  # decode-ahead steps run (VerifyRequest.decode_ahead)
        self.self_drafted_tokens = 0  # ... and the tokens their own lookup spans verified (ahead_lookup_tokens)
        self.prefills_cancelled = 0  # Prefill calls whose caller went away (cancel, deadline) before the reply

    def attach(self, engine: TargetEngine, tokenizer_fingerprint: str, calibration: CalibrationResult | None = None) -> None:
        self._engine = engine
        self.fingerprint = tokenizer_fingerprint
        self.calibration = calibration
        self.metrics.active_sessions.set_function(lambda: engine.num_sessions)  # exact at every scrape
        m, kvm = self.kv_metrics, engine.kv
        m.used_tokens.set_function(lambda: kvm.used_tokens)
        m.budget_tokens.set_function(lambda: kvm.budget_tokens)
        m.used_bytes.set_function(lambda: kvm.used_bytes)
        m.budget_bytes.set_function(lambda: kvm.budget_bytes)
        m.prefix_entries.set_function(lambda: engine.prefix.num_entries if engine.prefix else 0)
        m.prefix_tokens.set_function(lambda: kvm.prefix_tokens)
        if calibration is not None:
            export_calibration(self.metrics.registry, calibration, cpu_info().isa if engine.device.type == "cpu" else str(engine.device))

    @property
    def engine(self) -> TargetEngine:
        if self._engine is None:
            raise Unavailable("the target model is still loading")
        return self._engine

    @translate_errors
    async def GetModelInfo(
        self, request: common_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        e = self.engine
        cal = self.calibration
        return common_pb2.ModelInfo(
            model_name=e.model_name,
            vocab_size=e.vocab_size,
            eos_token_ids=e.eos_token_ids,
            max_context_tokens=e.max_context,
            dtype=str(e.dtype).removeprefix("torch."),
            device=str(e.device),
            tokenizer_fingerprint=self.fingerprint,
            backend=e.backend,
            numerics_chosen_by=cal.chosen_by if cal else "",
            cpu_isa=cpu_info().isa if e.device.type == "cpu" else "",
            forward_cost=_cost_points(cal.curve if cal else {}),
            calibrated=[
                common_pb2.CalibratedPair(
                    dtype=key.split("/")[0], backend=key.split("/")[1], forward_cost=_cost_points(curve),
                    score_tokens_per_s=cal.scores.get(key, 0.0), fidelity=_fidelity(cal.fidelity.get(key)),
                    admissible=key not in cal.excluded,
                )
                for key, curve in (cal.curves.items() if cal else ())
            ],
            fidelity=_fidelity(cal.fidelity.get(f"{cal.dtype}/{cal.backend}") if cal else None),
        )

    @translate_errors
    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.PrefillResponse:
        cfg = SamplingConfig.from_proto(request.sampling)
        ids = list(request.token_ids)
        if not ids:
            raise InvalidArgument("token_ids must not be empty")
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        if request.session_id:
            check_session_id(request.session_id)
        checks.check_prompt_fits(len(ids), self.engine.max_context, self.engine.kv_budget_tokens)  # before any work
        if self.draining:
            raise Unavailable("the target replica is shutting down; create the session on another replica")
        grammar = await self._grammar(request)
        top = int(request.top_logprobs) if request.return_logprobs else -1
        call = PrefillCall(ids, cfg, request.sample_next_token, int(request.rng_offset), top, grammar, request.session_id)
        job = asyncio.ensure_future(self.worker.submit(call))
        try:
            out, t = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The caller is gone while the prefill runs: a prefill still queued or
            # in chunks stops at its next chunk (CANCELLED, nothing kept); one that
            # finishes anyway has its session released as soon as it exists.
            call.cancel.set()
            self.prefills_cancelled += 1
            job.add_done_callback(self._release_orphan)
            raise
        # A caller that goes after this point (its deadline or cancel racing
        # the reply) is not seen here: gRPC ends such a call OK on this side.
        # It releases the id it chose instead (docs/reliability.md).
        self.metrics.observe("prefill", len(ids) - out.cached_tokens, t.queue_ms, t.compute_ms)
        if self.engine.prefix is not None:
            self.kv_metrics.prefix_queries.inc(len(ids))
            self.kv_metrics.prefix_hits.inc(out.cached_tokens)
        self._gauges()
        return target_pb2.PrefillResponse(
            session_id=out.session_id,
            has_next_token=out.next_token is not None,
            next_token_id=out.next_token or 0,
            next_token_logit_gap=out.logit_gap,
            cache_len=out.cache_len,
            timings=_timings(t),
            next_token_logprobs=_logprobs(out.logprobs)[0] if out.logprobs else None,
            grammar_applied=grammar is not None,
            grammar_dead_end=out.dead_end,
            cached_prompt_tokens=out.cached_tokens,
        )

    async def _grammar(self, request: target_pb2.PrefillRequest) -> GrammarState | None:
        """The new session's grammar state (compiled off the event loop, cached
        by content); UNAVAILABLE while loading, INVALID_ARGUMENT with
        llguidance's message for a grammar that does not compile."""
        engine = self.engine
        spec = GrammarSpec.from_proto(request.grammar if request.HasField("grammar") else None)
        if spec is None:
            return None
        if engine.grammars is None:
            raise Unavailable("this target replica has no tokenizer for structured output")
        if request.grammar_start > len(request.token_ids):
            raise InvalidArgument(f"grammar_start {request.grammar_start} is past the {len(request.token_ids)} tokens")
        return await asyncio.to_thread(engine.grammars.state, spec, int(request.grammar_start))

    @translate_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await self._verify(request)

    async def VerifyStream(
        self, request_iterator: AsyncIterator[target_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyResponse]:
        """Verify, request after request, on one stream (one per session on
        the caller's side). The first error ends the stream with Verify's
        status; the session is not released (Release or the TTL does that)."""
        self.verify_streams += 1
        try:
            async for request in request_iterator:  # an unparsable message raises InvalidArgument here
                reply = await self._verify(request)
                ahead = 0 if request.draft_token_ids or request.has_post_token else min(int(request.decode_ahead),
                                                                                       MAX_DECODE_AHEAD)
                lookup = int(request.ahead_lookup_tokens)  # then ahead counts tokens (one per plain step)
                stops = frozenset(request.stop_token_ids)
                while True:  # decode-ahead: the plain steps the caller would ask for next, without asking
                    emitted = [*reply.self_drafted_token_ids[: reply.num_accepted], reply.next_token_id]
                    more = ahead > 0 and not reply.grammar_dead_end and stops.isdisjoint(emitted)
                    reply.ahead_left = ahead if more else 0
                    yield reply
                    if not more:
                        break
                    self.ahead_steps += 1
                    reply = await self._verify(target_pb2.VerifyRequest(
                        session_id=request.session_id, cache_len=reply.cache_len, new_token_ids=[reply.next_token_id]),
                        lookup_tokens=min(lookup, ahead - 1))  # a step commits at most `ahead` tokens
                    ahead -= 1 + reply.num_accepted
                    self.self_drafted_tokens += len(reply.self_drafted_token_ids)
        except Exception as e:
            await abort_with(context, e, "VerifyStream")

    async def _verify(self, request: target_pb2.VerifyRequest, lookup_tokens: int = 0) -> target_pb2.VerifyResponse:
        """``lookup_tokens``: a decode-ahead step may verify the session's own
        prompt-lookup span of at most this many tokens (target_service/self_lookup.py)."""
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        draft_ids = list(request.draft_token_ids)
        q = _sparse_q(request.draft_probs)
        if not q:
            q = [None] * len(draft_ids)  # a drafter without probabilities: one-hot q
        post_id, post_q = _post(request)
        self.engine  # UNAVAILABLE while loading
        out, t = await self.worker.submit(
            VerifyCall(request.session_id, int(request.cache_len), list(request.new_token_ids), draft_ids, q,
                       post_id, post_q, lookup_tokens=max(0, lookup_tokens))
        )
        assert isinstance(out, VerifyOutcome)
        self.metrics.observe("verify", len(request.new_token_ids) + len(draft_ids), t.queue_ms, t.compute_ms)
        self._gauges()
        return target_pb2.VerifyResponse(
            num_accepted=out.result.num_accepted,
            next_token_id=out.result.next_token,
            next_is_bonus=out.result.is_bonus,
            next_is_post=out.result.is_post,
            cache_len=out.cache_len,
            logit_gaps=out.logit_gaps,
            timings=_timings(t),
            batch_size=t.batch_size,
            queue_depth=t.queue_depth,
            active_sessions=self.engine.num_sessions,
            logprobs=_logprobs(out.logprobs),
            grammar_dead_end=out.dead_end,
            self_drafted_token_ids=out.self_drafted,
        )

    @translate_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        # bookkeeping, not model work: never behind the bounded model queue
        # (under overload a Release must still free the KV cache). The
        # engine's lock guards its session table; a batch already running
        # with the session finishes on its own reference, and the cache is
        # freed when that step ends.
        released = self.engine.release(request.session_id)
        forget = getattr(self.worker, "forget", None)
        if forget is not None:
            forget(request.session_id)  # no longer a peer worth a batch window
        self._gauges()
        return common_pb2.ReleaseResponse(released=released)

    def _release_orphan(self, job: "asyncio.Future[Any]") -> None:
        if job.cancelled() or job.exception() is not None:
            return
        out, _ = job.result()
        assert isinstance(out, PrefillOutcome)
        self.engine.release(out.session_id)  # as Release: no model queue

    def on_batch(self, report: BatchReport) -> None:
        """Called on the model thread after each forward pass."""
        self.batch_metrics.observe(report.batch_size, report.batch_tokens)
        self.metrics.queue_depth.set(report.queue_depth)

    def _gauges(self) -> None:
        e = self.engine
        self.metrics.queue_depth.set(self.worker.pending)
        delta = e.evictions - self._evictions_seen
        if delta > 0:
            self.metrics.evictions.inc(delta)
            self._evictions_seen = e.evictions


@dataclass
class TargetServer:
    handle: ServerHandle
    engine: TargetEngine
    worker: BatchScheduler
    reaper: asyncio.Task[None]
    metrics_port: int | None = None
    servicer: TargetServicer | None = None

    @property
    def port(self) -> int:
        return self.handle.port

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown, step one: new sessions are refused, the open ones
        are served until their orchestrators release them (up to ``timeout_s``)."""
        if self.servicer is not None:
            self.servicer.draining = True
        await drain(self.handle, lambda: self.engine.num_sessions, timeout_s, "target")

    async def stop(self, grace: float | None = 5.0) -> None:
        self.reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reaper
        await self.handle.stop(grace)
        self.worker.shutdown()


async def _reap(engine: TargetEngine, ttl_s: float) -> None:
    """Releases idle sessions every ttl/4 (at least 1 s) until cancelled.
    Bookkeeping under the engine's lock, not through the model queue (a full
    queue must not stop it), and no error ends it: each is logged."""
    while True:
        await asyncio.sleep(max(1.0, ttl_s / 4))
        try:
            engine.reap_idle(ttl_s)
        except Exception as e:  # the reaper outlives any one failure
            log(logger, logging.ERROR, "idle-session reaper failed; retrying next period", error=repr(e))


def load_engine(config: TargetServiceConfig) -> tuple[TargetEngine, str, CalibrationResult]:
    """Resolves the model spec, calibrates the numerics (dtype/backend auto)
    and loads the engine (blocking; run off the loop)."""
    from transformers import AutoTokenizer

    from specdec.models import default_cache_dir, resolve
    from specdec.tokenization import tokenizer_fingerprint

    cache_dir = Path(config.cache_dir or default_cache_dir())
    resolved = resolve(config.model, cache_dir)
    gguf_path = resolved.gguf_path or (Path(config.gguf) if config.gguf else None)
    device = pick_device(config.device)
    set_threads(device, config.threads)
    set_mmap_threshold(config.memory_mmap_threshold_bytes)  # before the model's tensors are allocated
    calibration, model = calibrate(
        resolved.hf_dir, config.dtype, config.backend, device, cache_dir / "calibration", resolved.name,
        measure=config.calibrate, budget_s=config.calibration_budget_s, gguf_path=gguf_path,
    )
    engine = TargetEngine(
        resolved.hf_dir,
        dtype=calibration.dtype,
        backend=calibration.backend,
        model=model,
        gguf_path=gguf_path,
        device=config.device,
        threads=config.threads,
        max_sessions=config.max_sessions,
        kv_budget_tokens=config.kv_budget_tokens,
        kv_budget_bytes=config.kv_budget_bytes,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        prefill_share=config.prefill_share,
        prefix_cache=config.prefix_cache,
        prefix_cache_entries=config.prefix_cache_entries,
        protect_active_s=config.kv_protect_active_s,
        max_context_tokens=config.max_context_tokens,
        memory_trim_interval_s=config.memory_trim_interval_s,
        max_span=config.max_span,
        max_draft_support=config.max_draft_support,
        model_name=resolved.name,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.hf_dir))
    fingerprint = tokenizer_fingerprint(tokenizer)
    engine.grammars = LazyGrammarCompiler(tokenizer, engine.vocab_size, engine.eos_token_ids)
    return engine, fingerprint, calibration


def _warmup(engine: TargetEngine) -> None:
    """Batched prefill + verify, then an unbatched verify (kernels, allocations)."""
    outs = [o for o, _ in engine.run_batch([PrefillCall([0, 1, 2, 3], SamplingConfig(), True)] * 2)]
    if all(isinstance(o, PrefillOutcome) for o in outs):
        vs = engine.run_batch([VerifyCall(o.session_id, o.cache_len, [o.next_token or 0], [1, 2], [None] * 2) for o in outs])
        o, v = outs[0], vs[0][0]
        if isinstance(v, VerifyOutcome):
            engine.verify(o.session_id, v.cache_len, [v.result.next_token], [1, 2, 3, 4], [None] * 4)
    for o in outs:
        if isinstance(o, PrefillOutcome):
            engine.release(o.session_id)


async def start(config: TargetServiceConfig) -> TargetServer:
    """Binds the port (health NOT_SERVING), loads and warms the model off the
    event loop, then flips health to SERVING."""
    worker = BatchScheduler("target-model", max_queue=config.max_queue, limits=config.batch_limits())
    servicer = TargetServicer(worker)
    worker.on_batch = servicer.on_batch
    handle = await start_server(
        lambda server: target_pb2_grpc.add_TargetServicer_to_server(servicer, server),
        [target_pb2.DESCRIPTOR.services_by_name["Target"].full_name],
        config.host,
        config.port,
        config.max_message_bytes,
        health_port=config.health_port,
        tls=config.tls,
    )
    log(logger, logging.INFO, "target service listening (loading model)", port=handle.port)
    try:
        (engine, fingerprint, calibration), _ = await worker.run(load_engine, config)
        if config.warmup:
            await worker.run(_warmup, engine)
    except BaseException:
        await handle.stop(0)
        worker.shutdown()
        raise
    servicer.attach(engine, fingerprint, calibration)
    worker.attach(engine.run_batch)
    metrics_port = serve_metrics(servicer.metrics.registry, config.metrics_port, config.metrics_host)
    reaper = asyncio.create_task(_reap(engine, config.session_ttl_s))
    await handle.set_serving(True)
    log(logger, logging.INFO, "target service ready", port=handle.port, model=engine.model_name,
        dtype=calibration.dtype, backend=calibration.backend, chosen_by=calibration.chosen_by)
    return TargetServer(handle, engine, worker, reaper, metrics_port, servicer)
