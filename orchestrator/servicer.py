"""The public ``specdec.v1.Orchestrator`` servicer: request validation and
tokenization, the decode loop per Generate call, incremental detokenization
and stop strings, the final stats, and the access log. Start-up and
lifecycle live in orchestrator/server.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

import grpc

from orchestrator.clients import GrpcDraftClient, GrpcTargetClient
from orchestrator.config import OrchestratorConfig
from orchestrator.decode import DRAFT_MODES, DecodeParams, Decoder, RequestStats
from orchestrator.detokenizer import IncrementalDetokenizer, StopMatcher
from orchestrator.lookup import LOOKUP_DRAFTER, LocalLookup
from orchestrator.policy import AdaptiveConfig, PolicyFactory
from orchestrator.protocols import SessionOptions
from orchestrator.routing import Router
from orchestrator.telemetry import MetricsSink
from specdec.errors import InvalidArgument, SpecdecError
from specdec.grammar import GrammarSpec
from specdec.logging_util import log
from specdec.metrics import OrchestratorMetrics
from specdec.sampling import MAX_TOP_LOGPROBS, SamplingConfig, TokenLogprob
from specdec.tokenization import token_table
from specdec.validation import check_min_confidence, check_token_ids
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

logger = logging.getLogger("specdec.orchestrator")
access_logger = logging.getLogger("specdec.orchestrator.access")

#: chat roles a request may use (anything else is INVALID_ARGUMENT before the template sees it)
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

MODE_NAMES = {
    pb.SPECULATION_MODE_UNSPECIFIED: "adaptive",
    pb.SPECULATION_MODE_AUTO: "adaptive",
    pb.SPECULATION_MODE_OFF: "off",
    pb.SPECULATION_MODE_FIXED: "fixed",
    pb.SPECULATION_MODE_HEURISTIC: "heuristic",
}


@dataclass
class _Access:
    """What the access log and the request counter need to know about one
    Generate call, filled in as it runs."""

    started: float
    client: str = ""  # who called, read while the call is live (a finished call's peer is gone)
    deadline: float | None = None  # time.perf_counter() at the call's deadline, if it has one
    code: str = "OK"
    finish: int = 0  # a FinishReason, 0 until a stream finished
    emitted: int = 0
    decoder: Decoder | None = None
    error: str = ""


@dataclass
class ModelLimits:
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(
        self,
        config: OrchestratorConfig,
        tokenizer: Any,
        target: Router[GrpcTargetClient],
        draft: Router[GrpcDraftClient] | None,
        limits: ModelLimits,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.cfg = config
        self.tokenizer = tokenizer
        self._token_bytes: Callable[[int], bytes] | None = None  # id -> bytes, built at the first logprobs request
        self.target = target
        self.draft = draft
        self.limits = limits
        self.active = 0
        self.draining = False  # set on SIGTERM: new streams get UNAVAILABLE, running ones finish
        self.metrics = metrics or OrchestratorMetrics.create()
        self.policies = PolicyFactory(
            default_gamma=config.default_num_draft_tokens,
            gamma_max=config.max_num_draft_tokens,
            adaptive=AdaptiveConfig(gamma_max=config.adaptive_gamma_max, confidence_scale=config.confidence_stop_scale),
        )
        self.sink = MetricsSink(self.metrics, self.policies)
        self.default_drafter = ""
        self.refused_drafters: dict[str, str] = {}  # name -> why it was refused at start-up
        self.hosted_drafters: frozenset[str] = frozenset()  # every drafter the draft hosted when it attached
        self.target_device = ""  # ModelInfo.device of the target and of the draft once it attached
        self.draft_device = ""
        self.metrics_port: int | None = None
        self.speculation_max_streams = 0  # 0 = unlimited (set from the target at start)
        self.identify: Callable[[grpc.aio.ServicerContext], str] | None = None  # the server guard's client identity
        self._over_limit_at = -float("inf")  # last time more streams were active than the gate allows

    def _note_load(self) -> None:
        """Remembers when more streams than the load gate allows were active."""
        if self.speculation_max_streams and self.active > self.speculation_max_streams:
            self._over_limit_at = time.monotonic()

    def set_speculation_limit(self, max_streams: int, hold_s: float | None = None) -> None:
        """AUTO requests speculate only while at most ``max_streams`` streams
        are active (0 = always), and only once the load has stayed at or under
        it for ``hold_s`` seconds (hysteresis: the last streams of a busy
        period do not start drafting, which would cost a draft catch-up over
        their whole context for a few tokens): the load gate of every
        adaptive policy."""
        self.speculation_max_streams = max_streams
        hold = self.cfg.speculation_hold_s if hold_s is None else hold_s
        self._over_limit_at = -float("inf")

        def allow() -> bool:
            self._note_load()
            return time.monotonic() - self._over_limit_at >= hold

        self.policies.allow = allow if max_streams > 0 else None
        log(logger, logging.INFO, "speculation load gate", max_streams=max_streams or "unlimited", hold_s=hold)

    @property
    def draft_prefill_overlap(self) -> bool:
        """Whether unary requests overlap the draft's prompt prefill with the
        target's (``draft_prefill_overlap``; auto: unless both run on CPU)."""
        mode = self.cfg.draft_prefill_overlap
        if mode != "auto":
            return mode == "on"
        return not (self.target_device.startswith("cpu") and self.draft_device.startswith("cpu"))

    @property
    def max_prompt_chars(self) -> int:
        """Characters a prompt may have: the configured cap, and no more than
        the context could hold at ``max_prompt_chars_per_context_token``."""
        return min(self.cfg.max_prompt_chars, self.cfg.max_prompt_chars_per_context_token * self.limits.max_context)

    # ------------------------------------------------------------ validation
    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        given = [bool(req.prompt), len(req.prompt_token_ids) > 0, len(req.messages) > 0]
        if sum(given) == 0:
            raise InvalidArgument("empty prompt: set one of prompt, prompt_token_ids or messages")
        if sum(given) > 1:
            raise InvalidArgument("set exactly one of prompt, prompt_token_ids and messages")
        if req.prompt_token_ids:
            ids = list(req.prompt_token_ids)
            check_token_ids(ids, self.limits.vocab_size, "prompt_token_ids")
            return ids
        if req.messages:
            msgs = []
            for i, m in enumerate(req.messages):
                if not m.role:
                    raise InvalidArgument(f"messages[{i}].role is empty")
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"messages[{i}].role {m.role[:32]!r} is not one of {', '.join(sorted(CHAT_ROLES))}"
                    )
                msgs.append({"role": m.role, "content": m.content})
            if sum(len(m["content"]) for m in msgs) > self.max_prompt_chars:
                raise InvalidArgument(f"messages exceed {self.max_prompt_chars} characters (the model's context "
                                      f"holds {self.limits.max_context} tokens)")
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # template errors are the caller's (e.g. bad role order)
                raise InvalidArgument(f"messages could not be rendered with the chat template: {e}") from None
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(req.prompt) > self.max_prompt_chars:
            raise InvalidArgument(f"prompt of {len(req.prompt)} characters exceeds {self.max_prompt_chars} (the "
                                  f"model's context holds {self.limits.max_context} tokens)")
        ids = list(self.tokenizer(req.prompt)["input_ids"])
        if not ids:
            raise InvalidArgument("prompt tokenizes to no tokens")
        return ids

    def _params(self, req: pb.GenerateRequest, prompt_ids: list[int], deadline: float | None) -> DecodeParams:
        sampling = SamplingConfig.from_proto(req.sampling if req.HasField("sampling") else None)
        if sampling.top_k > self.limits.vocab_size:
            raise InvalidArgument(f"sampling.top_k {sampling.top_k} exceeds the vocabulary size {self.limits.vocab_size}")
        max_new = req.max_new_tokens or self.cfg.default_max_new_tokens
        if max_new > self.cfg.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens {max_new} exceeds the limit {self.cfg.max_new_tokens_limit}")
        context_limited = False
        if len(prompt_ids) + max_new > self.limits.max_context - 1:
            if len(prompt_ids) >= self.limits.max_context - 1:
                raise InvalidArgument(
                    f"prompt of {len(prompt_ids)} tokens leaves no room in the model context of {self.limits.max_context}"
                )
            max_new = self.limits.max_context - len(prompt_ids) - 1
            context_limited = True
        if len(req.stop) > self.cfg.max_stop_strings:
            raise InvalidArgument(f"at most {self.cfg.max_stop_strings} stop strings are allowed")
        for s in req.stop:
            if not s or len(s) > self.cfg.max_stop_string_chars:
                raise InvalidArgument(f"stop strings must be 1..{self.cfg.max_stop_string_chars} characters")
        if req.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
        if req.top_logprobs and not req.return_logprobs:
            raise InvalidArgument("top_logprobs needs return_logprobs")
        grammar = GrammarSpec.from_proto(req.structured_output) if req.HasField("structured_output") else None
        options = SessionOptions(top_logprobs=int(req.top_logprobs) if req.return_logprobs else -1,
                                 grammar=grammar, grammar_start=len(prompt_ids))
        spec = req.speculation
        if spec.num_draft_tokens > self.cfg.max_num_draft_tokens:
            raise InvalidArgument(
                f"speculation.num_draft_tokens {spec.num_draft_tokens} exceeds the limit {self.cfg.max_num_draft_tokens}"
            )
        if spec.mode not in MODE_NAMES:
            raise InvalidArgument(f"unknown speculation.mode {spec.mode}")
        check_min_confidence(spec.min_confidence, "speculation.min_confidence", allow_one=False)
        if spec.draft_mode and spec.draft_mode not in DRAFT_MODES:
            raise InvalidArgument(f"speculation.draft_mode must be one of {', '.join(DRAFT_MODES)} (or empty), "
                                  f"got {spec.draft_mode!r}")
        draft_mode = spec.draft_mode or self.cfg.draft_mode
        mode = MODE_NAMES[spec.mode]
        speculate = mode != "off" and self.draft is not None
        if speculate and spec.drafter in self.refused_drafters:
            raise InvalidArgument(f"speculation.drafter {spec.drafter!r} was refused at start-up: "
                                  f"{self.refused_drafters[spec.drafter]}")
        drafter = spec.drafter or self.default_drafter
        policy = self.policies.make(mode if speculate else "off", spec.num_draft_tokens, drafter,
                                    streamed=draft_mode != "unary")
        lookup = lookup_policy = None
        lookup_label = f"{drafter}:lookup"
        if (speculate and mode in ("adaptive", "fixed") and drafter == LOOKUP_DRAFTER and self.cfg.local_lookup
                and draft_mode == "unary" and grammar is None):
            lookup = LocalLookup()
            lookup_policy = (self.policies.make_local(lookup_label, spec.num_draft_tokens) if mode == "adaptive"
                             else self.policies.make("fixed", spec.num_draft_tokens, lookup_label))
        return DecodeParams(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            sampling=sampling,
            policy=policy,
            speculate=speculate,
            drafter=spec.drafter,
            drafter_label=spec.drafter or self.default_drafter,
            hosted_drafters=self.hosted_drafters,
            draft_timeout_s=self.cfg.draft_timeout_s,
            draft_retry_after_rounds=self.cfg.draft_retry_after_rounds,
            target_timeout_s=self.cfg.target_timeout_s,
            release_timeout_s=self.cfg.release_timeout_s,
            deadline=deadline,
            # 0 leaves AUTO's per-round threshold to its policy (derived from costs)
            min_confidence=spec.min_confidence or (self.cfg.min_confidence if mode == "adaptive" else 0.0),
            sink=self.sink,
            context_limited=context_limited,
            draft_mode=draft_mode,
            run_ahead_tokens=self.cfg.run_ahead_tokens,
            decode_ahead=self.cfg.decode_ahead,  # the target client applies it on Verify streams only
            stop_token_ids=frozenset() if req.ignore_eos else self.limits.eos_token_ids,
            options=options,
            draft_options=replace(options, top_logprobs=-1, grammar=options.grammar if self.cfg.draft_grammar else None),
            draft_prefill_overlap=self.draft_prefill_overlap,
            lookup=lookup,
            lookup_policy=lookup_policy,
            lookup_label=lookup_label,
            max_lookup_tokens=spec.num_draft_tokens or self.policies.adaptive.gamma_max,
            # the draft's grammar follows the whole sequence: with one, it takes in every token
            draft_window=self.cfg.draft_context_window if options.grammar is None else 0,
            draft_sink=self.cfg.draft_context_sink,
        )

    # -------------------------------------------------------------- Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams one generation; whatever ends it, the request is counted by
        its final status code and written to the access log once."""
        # The client's identity is read now: after a cancel, grpc may have freed
        # the call, and reading its peer or auth context then crashes the process.
        rec = _Access(started=time.perf_counter(),
                      client=self.identify(context) if self.identify is not None else (context.peer() or ""))
        remaining = context.time_remaining()
        rec.deadline = time.perf_counter() + remaining if remaining is not None else None
        try:
            async for chunk in self._generate(request, context, rec):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            if rec.code == "OK":
                expired = rec.deadline is not None and time.perf_counter() >= rec.deadline
                rec.code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except BaseException as e:
            if rec.code == "OK":  # not a status this servicer chose (an abort sets it first)
                rec.code, rec.error = "INTERNAL", repr(e)[:200]
            raise
        finally:
            self._account(rec, request)

    async def _abort(self, context: grpc.aio.ServicerContext, rec: "_Access", code: grpc.StatusCode, message: str) -> None:
        rec.code, rec.error = code.name, message[:200]
        await context.abort(code, message)

    def _account(self, rec: "_Access", request: pb.GenerateRequest) -> None:
        finish = pb.FinishReason.Name(rec.finish) if rec.finish else "NONE"
        self.metrics.requests.labels(finish, rec.code).inc()
        d = rec.decoder
        stats = d.stats if d is not None else None
        wall = time.perf_counter() - rec.started
        fields: dict[str, Any] = {
            "client": rec.client,
            "code": rec.code, "finish_reason": finish, "duration_ms": round(wall * 1e3, 1),
            "mode": MODE_NAMES.get(request.speculation.mode, str(request.speculation.mode)),
        }
        if d is not None and stats is not None:
            ttft = (stats.first_token_at - stats.started) * 1e3 if stats.first_token_at is not None else None
            fields.update(
                prompt_tokens=stats.prompt_tokens, cached_prompt_tokens=stats.cached_prompt_tokens,
                draft_cached_prompt_tokens=stats.draft_cached_prompt_tokens, new_tokens=rec.emitted,
                drafter=d.p.drafter_label if d.draft is not None else "", policy=d.p.policy.name,
                ttft_ms=round(ttft, 1) if ttft is not None else None,
                tokens_per_s=round(rec.emitted / wall, 2) if wall > 0 else 0.0,
                acceptance=round(stats.acceptance_rate, 3), rounds=stats.rounds,
                lookup_rounds=stats.lookup_rounds, lookup_tokens=stats.lookup_tokens,
                draft_failures=stats.draft_failures, target_rebuilds=stats.target_rebuilds,
            )
        if rec.error:
            fields["error"] = rec.error
        log(access_logger, logging.INFO, "request", **fields)

    def on_rejected(self, method: str, code: grpc.StatusCode, reason: str, client: str) -> None:
        """A call the server guard refused before it reached a servicer
        (authentication, unparsable request, expired deadline, per-client
        limit): counted and logged like any other request."""
        if method.endswith("/Generate"):
            self.metrics.requests.labels("NONE", code.name).inc()
        log(access_logger, logging.INFO, "request", client=client, method=method, code=code.name,
            finish_reason="NONE", error=reason[:200])

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, rec: "_Access"
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            await self._abort(context, rec, grpc.StatusCode.UNAVAILABLE, "the orchestrator is shutting down; retry")
        if self.active >= self.cfg.max_concurrent_streams:
            await self._abort(context, rec, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"too many concurrent streams ({self.cfg.max_concurrent_streams})")
        self.active += 1
        self._note_load()
        self.metrics.active_streams.inc()
        decoder: Decoder | None = None
        try:
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
            if request.return_logprobs and self._token_bytes is None:
                await asyncio.to_thread(self._load_token_bytes)  # once: the tokenizer's id -> bytes table
            params = self._params(request, prompt_ids, deadline)
            key = uuid.uuid4().hex  # the session-affinity key of this request's target session
            decoder = Decoder(self.target.bind(key), self.draft.bind(key) if self.draft else None, params)
            rec.decoder = decoder
            async for chunk in self._stream(decoder, request, rec):
                yield chunk
        except SpecdecError as e:
            await self._abort(context, rec, e.code, e.message)
        finally:
            self._note_load()
            self.active -= 1
            self.metrics.active_streams.dec()
            if decoder is not None:
                await decoder.close()

    async def _stream(
        self, decoder: Decoder, req: pb.GenerateRequest, rec: "_Access"
    ) -> AsyncIterator[pb.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer, decoder.p.prompt_ids)
        # the stop-string automaton is linear in the stops' total length (up to
        # 16 x 256 characters, ~10 ms): a large one is built off the loop
        stop_chars = sum(len(s) for s in req.stop)
        stops = StopMatcher(list(req.stop)) if stop_chars <= 512 else await asyncio.to_thread(StopMatcher, list(req.stop))
        eos = frozenset() if req.ignore_eos else self.limits.eos_token_ids
        max_new = decoder.p.max_new_tokens
        at_max = pb.FINISH_REASON_CONTEXT_LENGTH if decoder.p.context_limited else pb.FINISH_REASON_LENGTH
        emitted = 0
        finish = at_max
        steps = decoder.run()
        try:
            async for step in steps:
                ids: list[int] = []
                gaps: list[float] = []
                lps = step.logprobs[: len(step.token_ids)]
                done = False
                for tok, gap in zip(step.token_ids, step.logit_gaps + [0.0] * len(step.token_ids)):
                    ids.append(tok)
                    gaps.append(gap)
                    emitted += 1
                    rec.emitted = emitted
                    if tok in eos:
                        finish, done = pb.FINISH_REASON_EOS, True
                        break
                    if emitted >= max_new:
                        finish, done = at_max, True
                        break
                if step.dead_end and not done:
                    finish, done = pb.FINISH_REASON_GRAMMAR_DEAD_END, True
                text, kept = stops.push_tokens(detok, ids)
                if stops.stopped:
                    # the tokens past the one that completed the stop string are dropped
                    emitted -= len(ids) - kept
                    rec.emitted = emitted
                    del ids[kept:], gaps[kept:]
                    finish, done = pb.FINISH_REASON_STOP, True
                if done:
                    text += stops.push(detok.flush()) if not stops.stopped else ""
                    text += stops.flush()
                    rec.finish = finish
                    yield self._chunk(text, ids, gaps, req, finish, decoder, emitted, lps[: len(ids)])
                    return
                if text or ids:
                    yield self._chunk(text, ids, gaps, req, None, None, emitted, lps)
            # the loop ended on max_new_tokens exactly at a round boundary
            rec.finish = finish
            yield self._chunk(stops.flush(), [], [], req, finish, decoder, emitted)
        finally:
            await steps.aclose()

    def _chunk(
        self,
        text: str,
        ids: list[int],
        gaps: list[float],
        req: pb.GenerateRequest,
        finish: int | None,
        decoder: Decoder | None,
        emitted: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> pb.GenerateResponse:
        msg = pb.GenerateResponse(text=text, token_ids=ids)
        if req.return_logprobs and logprobs:
            msg.logprobs.extend(self._logprobs_proto(logprobs))
        stats = decoder.stats if decoder is not None else None
        policy_name = decoder.p.policy.name if decoder is not None else ""
        drafter = decoder.p.drafter_label if decoder is not None and decoder.draft else ""
        if req.return_logit_gaps:
            msg.logit_gaps.extend(gaps)
        if finish is not None and stats is not None:
            msg.finish_reason = finish  # type: ignore[assignment]
            msg.stats.CopyFrom(stats_proto(stats, emitted))
            msg.stats.policy = policy_name
            msg.stats.drafter = drafter
            self.metrics.generated_tokens.inc(emitted)
            if stats.first_token_at is not None:
                self.metrics.ttft.observe(stats.first_token_at - stats.started)
        return msg

    def _load_token_bytes(self) -> Callable[[int], bytes]:
        if self._token_bytes is None:
            self._token_bytes = token_table(self.tokenizer).get
        return self._token_bytes

    def _logprobs_proto(self, lps: list[TokenLogprob]) -> list[common_pb2.TokenLogprobs]:
        """The target's logprobs with each token's bytes."""
        tb = self._token_bytes or self._load_token_bytes()

        def one(token_id: int, logprob: float) -> common_pb2.TokenLogprob:
            return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token=tb(token_id))

        return [common_pb2.TokenLogprobs(chosen=one(lp.token_id, lp.logprob), top=[one(t, v) for t, v in lp.top])
                for lp in lps]


def stats_proto(s: RequestStats, generated: int) -> pb.GenerationStats:
    now = time.perf_counter()
    total_ms = (now - s.started) * 1e3
    ttft = ((s.first_token_at or now) - s.started) * 1e3
    return pb.GenerationStats(
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        rounds=s.rounds,
        mean_accepted_length=s.mean_accepted_length,
        time_to_first_token_ms=ttft,
        tokens_per_second=generated / (total_ms / 1e3) if total_ms > 0 else 0.0,
        acceptance_rate=s.acceptance_rate,
        prompt_tokens=s.prompt_tokens,
        generated_tokens=generated,
        total_ms=total_ms,
        draft_ms=s.draft_ms,
        verify_ms=s.verify_ms,
        prefill_ms=s.prefill_ms,
        # drafting hidden behind verification took no wall time of its own
        overhead_ms=max(0.0, total_ms - (s.draft_ms - s.draft_hidden_ms) - s.verify_ms),
        gamma_trajectory=s.gamma_trajectory,
        accepted_per_round=s.accepted_per_round,
        draft_failures=s.draft_failures,
        target_rebuilds=s.target_rebuilds,
        round_trip_ms=s.rtt_ms,
        draft_mode=s.draft_mode,
        draft_hidden_ms=s.draft_hidden_ms,
        post_verified=s.post_verified,
        round_overhead_p50_ms=s.round_overhead_p50_ms,
        round_overhead_p99_ms=s.round_overhead_p99_ms,
        cached_prompt_tokens=s.cached_prompt_tokens,
        draft_cached_prompt_tokens=s.draft_cached_prompt_tokens,
    )
