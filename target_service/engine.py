"""Target engine: a transformers causal LM with per-session KV caches,
prefill, exact span verification and rollback. Plain Python, no gRPC. The
calls it serves are in target_service/calls.py, model loading in
target_service/loading.py.

The session table, KV budget, admission and eviction live in
target_service/kv_manager.py (``engine.kv``).

Every public method runs on the model worker thread (see
``specdec.grpc_util.ModelWorker``), so sessions are never mutated
concurrently; the servicer only validates and dispatches. The exceptions are
:meth:`TargetEngine.release` and :meth:`TargetEngine.reap_idle`: they only
drop entries from the session table under its lock, so the servicer calls
them from the event loop (a Release must not wait behind, or be refused by,
a full model queue); a batch running with a released session finishes on
its own reference to it.

Chunked prefill (``prefill_chunk_tokens`` > 0): a longer prompt is prefilled
that many tokens per forward, all into its one session cache. The first chunk
admits the session and reserves the whole prompt in the KV budget; each chunk
but the last answers ``Requeue`` of the next ``PrefillChunk``, which the
scheduler queues behind the calls that arrived meanwhile; the last one's
logits give the next token. A cancelled caller, or a Release of the id, stops
it at its next chunk and frees the reservation.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

import torch

from specdec.errors import Cancelled, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, SpecdecError
from specdec.logging_util import log
from specdec.sampling import (
    SamplingConfig,
    SparseQ,
    VerifyResult,
    argmax_rows,
    greedy_verify,
    logit_gaps,
    process_logits,
    rejection_sample,
    sample,
    session_generator,
    token_logprobs,
)
from specdec.memory import TrimPacer
from specdec.ngram import TrustedLookup
from specdec.session_ids import new_session_id
from specdec.tokenization import eos_token_ids
from specdec.validation import check_token_ids
from specdec.grammar import GrammarState, LazyGrammarCompiler
from target_service.batching import Requeue
from target_service.calls import (Call, ForwardInfo, Outcome, PrefillCall, PrefillChunk, PrefillOutcome, VerifyCall,
                                  VerifyOutcome)
from target_service import kv_adapter as kv
from target_service import runner
from target_service.kv_manager import KVManager, kv_bytes_per_token
from target_service.prefix_cache import PrefixCache
from target_service import self_lookup, session_prefix
from target_service.chunking import ChunkSizer
from target_service import checks
from target_service.constrained import mask_rows
from target_service.loading import load_model, output_vocab_size, parse_dtype, pick_device, set_threads

logger = logging.getLogger("specdec.target")


@dataclass
class TargetSession:
    session_id: str
    cfg: SamplingConfig
    generator: torch.Generator
    cache: kv.DynamicCache
    cache_len: int = 0
    last_used: float = field(default_factory=time.monotonic)
    top_logprobs: int = -1  # logprobs of every emitted token with this many top tokens; -1 = none
    grammar: GrammarState | None = None  # structured output: follows the committed tokens
    tokens: list[int] = field(default_factory=list)  # the tokens the cache holds (for the prefix cache)
    cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache
    lookup: TrustedLookup | None = None  # decode-ahead prompt lookup over ``tokens`` (target_service/self_lookup.py)


@dataclass
class _Row:
    call: Call
    sess: TargetSession
    ids: list[int]  # tokens this forward appends to the session's cache
    keep: int  # logits rows needed (the last ``keep`` positions of ``ids``)
    past: int  # tokens already in the session's cache
    chunked: bool = False  # a part of a prefill in chunks (its prompt is reserved in the KV manager)


class TargetEngine:
    """Owns the model and the sessions' KV caches."""

    def __init__(
        self,
        hf_dir: Path,
        *,
        dtype: str = "bfloat16",
        device: str = "auto",
        threads: int = 0,
        max_sessions: int = 64,
        kv_budget_tokens: int = 65_536,
        kv_budget_bytes: int = 0,
        protect_active_s: float = 10.0,
        prefill_chunk_tokens: int = 0,
        prefill_share: float = 0.0,
        prefix_cache: bool = False,
        prefix_cache_entries: int = 64,
        prefix_cache_min_tokens: int = 16,
        max_context_tokens: int = 0,
        memory_trim_interval_s: float = 1.0,
        max_span: int = 32,
        max_draft_support: int = 4096,
        model_name: str | None = None,
        backend: str = "eager",
        model: torch.nn.Module | None = None,
        gguf_path: Path | None = None,
    ) -> None:
        """``model``: an already loaded and converted model for (dtype,
        backend) on ``device`` (start-up calibration hands over the one it
        measured last); None loads it from ``hf_dir`` (and, for the
        quantized backends, its linear layers from ``gguf_path``).
        ``kv_budget_bytes`` > 0 replaces ``kv_budget_tokens`` (see
        target_service/kv_manager.py); ``prefill_chunk_tokens`` 0 = every
        prompt in one forward. ``prefix_cache``: keep prompts and released
        sessions' tokens with their KV and start a new prompt from the
        longest stored prefix (target_service/prefix_cache.py).
        ``memory_trim_interval_s``: between batches, at most this often, the
        heap's free pages go back to the system (specdec/memory.py; < 0 = never)."""
        self.device = pick_device(device)
        self.dtype = parse_dtype(dtype)
        self.backend = backend
        set_threads(self.device, threads, backend)
        if model is None:
            model = load_model(hf_dir, self.dtype, backend, self.device, model_name, gguf_path)
        self.model = model
        cfg = self.model.config
        self.model_name = model_name or Path(hf_dir).name
        self.vocab_size = output_vocab_size(self.model)
        model_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 32_768)
        self.max_context = min(model_ctx, max_context_tokens) if max_context_tokens else model_ctx
        # a session never evicts one used within protect_active_s seconds: it is
        # refused (RESOURCE_EXHAUSTED) instead, so that admission past the KV
        # budget cannot make running requests thrash (0 = plain LRU)
        self.kv: KVManager[TargetSession] = KVManager(
            budget_tokens=kv_budget_tokens, budget_bytes=kv_budget_bytes, max_sessions=max_sessions,
            bytes_per_token=kv_bytes_per_token(cfg, str(self.dtype)), protect_active_s=protect_active_s,
        )
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # while other sessions decode, a chunk costs about prefill_share of their steps (0 = fixed chunks)
        self.chunks = ChunkSizer(prefill_chunk_tokens, prefill_share)
        # the prefix cache needs plain growing layers (sliding-window or quantized ones keep their own layout)
        self.prefix: PrefixCache | None = None
        if prefix_cache and kv.batchable(kv.new_cache(cfg)):
            self.prefix = PrefixCache(max_entries=prefix_cache_entries, min_hit_tokens=prefix_cache_min_tokens)
        self.kv.prefix = self.prefix
        self._parked: list[TargetSession] = []  # released sessions, stored in the prefix cache by the model thread
        self._parked_lock = threading.Lock()
        # KV tensors are freed and reallocated a little larger every step, and a batched
        # forward copies every session's cache into one padded batch: glibc keeps what
        # they free in the heap, and RSS would follow their high-water mark (specdec/memory.py)
        self.trim = TrimPacer(memory_trim_interval_s)
        self.prefill_chunks = 0  # chunk forwards run (chunked prefills only)
        self._measured = False  # whether kv.bytes_per_token was measured on a real cache
        self.max_span = max_span
        self.max_draft_support = max_draft_support
        self.eos_token_ids = eos_token_ids(
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
            getattr(self.model.config, "eos_token_id", None),
        )
        # transformers >= 5.2x renames `past_key_values` to `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.grammars: LazyGrammarCompiler | None = None  # structured output; set with the tokenizer (server.py)

    # ------------------------------------------------------------------ state
    @property
    def num_sessions(self) -> int:
        return self.kv.num_sessions

    @property
    def cached_tokens(self) -> int:
        return self.kv.cached_tokens

    @property
    def kv_budget_tokens(self) -> int:
        return self.kv.budget_tokens

    @property
    def evictions(self) -> int:
        return self.kv.evictions

    def referenced_kv_bytes(self) -> int:
        """Bytes of the KV storages the sessions, the parked released
        sessions and the prefix cache's entries keep alive, each storage
        once: what the KV manager's count (``kv.used_bytes``) should match
        (tests/test_kv_memory.py)."""
        with self._parked_lock:
            parked = list(self._parked)
        sessions = [s for s in (self.kv.peek(sid) for sid in self.kv.session_ids()) if s is not None] + parked
        return session_prefix.referenced_bytes(sessions, self.prefix)

    def release(self, session_id: str) -> bool:
        """Frees the session; True when it existed (see KVManager.release).
        With the prefix cache on, its tokens and KV are kept as an entry: the
        model thread stores it before its next batch (a batch running with
        the session now finishes first, so the entry sees its final state)."""
        sess = self.kv.pop(session_id)
        if sess is not None and self.prefix is not None:
            with self._parked_lock:
                self._parked.append(sess)
        return sess is not None

    def _store_parked(self) -> None:
        """Model thread, between batches: released sessions become prefix entries."""
        with self._parked_lock:
            parked, self._parked = self._parked, []
        for sess in parked:
            self._store_prefix(sess)

    def _store_prefix(self, sess: TargetSession) -> None:
        session_prefix.store(self.prefix, self.kv, sess)

    def reap_idle(self, ttl_s: float) -> int:
        """Releases sessions idle for longer than ``ttl_s``; returns how many."""
        return self.kv.reap_idle(ttl_s)

    # ------------------------------------------------------------- validation
    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        check_token_ids(ids, self.vocab_size, what)

    def check_draft_q(self, draft_ids: Sequence[int], draft_q: Sequence[SparseQ | None]) -> None:
        checks.check_draft_q(draft_ids, draft_q, self.vocab_size, self.max_draft_support)

    def check_post(self, post_id: int, post_q: SparseQ | None, greedy: bool) -> None:
        checks.check_post(post_id, post_q, greedy, self.vocab_size, self.max_draft_support)

    # ---------------------------------------------------------------- compute
    def _forward(self, cache: kv.DynamicCache, ids: Sequence[int], keep: int) -> torch.Tensor:
        """Appends ``ids`` to ``cache``; returns the logits of the last ``keep``
        positions, [keep, V] float32 (target_service/runner.py)."""
        return runner.forward(self.model, self.device, self._cache_kwarg, cache, ids, keep)

    @staticmethod
    def _batchable(rows: Sequence[_Row]) -> bool:
        """Rows can share one forward when every cache layer is a plain
        (full-attention, growing) DynamicLayer: sliding-window or quantized
        layers keep their own layout and run one row per forward."""
        return all(kv.batchable(r.sess.cache) for r in rows)

    def _forward_batch(self, rows: Sequence[_Row]) -> list[torch.Tensor]:
        """One forward pass over several sessions (target_service/runner.py)."""
        return runner.forward_batch(self.model, self.device, self._cache_kwarg,
                                    [runner.BatchRow(r.sess.cache, r.ids, r.keep, r.past) for r in rows])

    def _pick(self, logits: torch.Tensor, sess: TargetSession) -> int:
        """One plain decoding step from logits [V]."""
        if sess.cfg.greedy:
            return argmax_rows(logits[None])[0]
        return sample(process_logits(logits[None], sess.cfg)[0], sess.generator)

    def _prepare_prefill(self, call: PrefillCall, protect: set[str], reserved: int, new_sessions: int) -> _Row:
        token_ids, cfg = call.token_ids, call.cfg
        if not token_ids:
            raise InvalidArgument("token_ids must not be empty")
        self.check_token_ids(token_ids, "token_ids")
        if cfg.top_k > self.vocab_size:
            raise InvalidArgument(f"sampling.top_k {cfg.top_k} exceeds the vocabulary size {self.vocab_size}")
        checks.check_prompt_fits(len(token_ids), self.max_context, self.kv_budget_tokens)
        if call.cancel.is_set():
            raise Cancelled("the caller cancelled this prefill before it started")
        self.kv.admit(call.requested_id, protect, new_sessions)
        self.kv.make_room(reserved + len(token_ids), protect, f"a prompt of {len(token_ids)} tokens")
        sess = TargetSession(
            session_id=call.requested_id or new_session_id(),
            cfg=cfg,
            generator=session_generator(cfg.seed, call.rng_offset),
            cache=kv.new_cache(self.model.config),
            top_logprobs=call.top_logprobs,
            grammar=call.grammar,
        )
        if sess.grammar is not None:
            sess.grammar.follow(token_ids, 0)  # a rebuilt session's generated tokens (prompt tokens are skipped)
        sess.tokens = list(token_ids)
        past = session_prefix.start_from(self.prefix, sess, token_ids)
        chunk = self._chunk_tokens(sess.session_id)
        if chunk and len(token_ids) - past > chunk:  # in chunks: the whole prompt is held in the budget meanwhile
            self.kv.reserve(sess.session_id, len(token_ids))
            return _Row(call, sess, list(token_ids[past : past + chunk]), 1, past, chunked=True)
        return _Row(call, sess, list(token_ids[past:]), 1, past)

    def _prepare_chunk(self, call: PrefillChunk) -> _Row:
        """The next chunk of a prefill in progress; CANCELLED once its caller
        is gone, NOT_FOUND once its id was released (the reservation is
        dropped by run_batch)."""
        n = len(call.call.token_ids)
        if call.call.cancel.is_set():
            raise Cancelled(f"the caller cancelled this prefill after {call.done} of its {n} prompt tokens")
        if self.kv.released_early(call.session_id):
            raise NotFound(f"target session {call.session_id!r} was released before its Prefill finished")
        ids = call.call.token_ids[call.done : call.done + (self._chunk_tokens(call.session_id) or call.chunk)]
        return _Row(call, call.sess, list(ids), 1, call.done, chunked=True)

    def _chunk_tokens(self, session_id: str) -> int:
        """The next chunk's size (target_service/chunking.py); 0 = no chunking."""
        sizer = self.chunks
        return sizer.size(bool(sizer.chunk_tokens) and self.kv.others_active(session_id, sizer.active_window_s()))

    def _time_forward(self, group: Sequence[tuple[int, _Row]], ms: float) -> None:
        tokens = sum(len(r.ids) for _, r in group)
        alone = group[0][1] if len(group) == 1 else None
        self.chunks.observe(decode=all(isinstance(r.call, VerifyCall) for _, r in group),
                            prefill=alone is not None and not isinstance(alone.call, VerifyCall)
                            and (alone.chunked or tokens >= 16), tokens=tokens, ms=ms)

    def _prepare_verify(self, call: VerifyCall, protect: set[str], reserved: int) -> _Row:
        sess = self.kv.get(call.session_id)
        new_ids, draft_ids = call.new_ids, call.draft_ids
        if not new_ids:
            raise InvalidArgument("new_token_ids must hold at least one token")
        if len(draft_ids) > self.max_span:
            raise InvalidArgument(f"drafted span of {len(draft_ids)} exceeds the limit {self.max_span}")
        self.check_token_ids(new_ids, "new_token_ids")
        self.check_token_ids(draft_ids, "draft_token_ids")
        if not sess.cfg.greedy:
            self.check_draft_q(draft_ids, call.draft_q)
        if call.post_id is not None:
            self.check_post(call.post_id, call.post_q, sess.cfg.greedy)
        if call.cache_len != sess.cache_len:
            raise FailedPrecondition(
                f"cache_len mismatch: session holds {sess.cache_len} tokens, request assumes {call.cache_len}"
            )
        if call.lookup_tokens > 0 and not draft_ids and call.post_id is None:
            call = self_lookup.self_draft(call, sess, self.max_span, self.max_context)
            draft_ids = call.draft_ids
        total = sess.cache_len + len(new_ids) + len(draft_ids)
        if total >= self.max_context:
            raise InvalidArgument(f"sequence of {total} tokens exceeds the context of {self.max_context} tokens")
        # growth: only idle sessions give way (an active one is never evicted for it)
        self.kv.make_room(reserved + len(new_ids) + len(draft_ids), protect | {call.session_id},
                          f"session {call.session_id!r} growing by {len(new_ids) + len(draft_ids)} tokens")
        if sess.grammar is not None:
            sess.grammar.follow(new_ids, sess.cache_len)  # usually the token this session emitted last
        return _Row(call, sess, list(new_ids) + list(draft_ids), len(draft_ids) + 1, sess.cache_len)

    def _finish_chunk(self, row: _Row, logits: torch.Tensor) -> Union[PrefillOutcome, Requeue]:
        """A chunk ran: the next one goes back to the scheduler, the last one
        finishes the prefill with its logits."""
        call = row.call if isinstance(row.call, PrefillCall) else row.call.call  # type: ignore[union-attr]
        assert isinstance(call, PrefillCall)
        self.prefill_chunks += 1
        done = row.past + len(row.ids)
        row.sess.cache_len = done  # for the KV manager's view of a cache in progress (not in the table yet)
        if done < len(call.token_ids):
            return Requeue(PrefillChunk(call, row.sess, done, self.prefill_chunk_tokens or len(row.ids)))
        return self._finish_prefill(row, logits, call)

    def _finish_prefill(self, row: _Row, logits: torch.Tensor, call: PrefillCall | None = None) -> PrefillOutcome:
        sess = row.sess
        call = call or row.call  # type: ignore[assignment]
        assert isinstance(call, PrefillCall)
        sess.cache_len = len(call.token_ids)
        nxt: int | None = None
        gap = 0.0
        lps = []
        dead = False
        if call.sample_next:
            last = logits[-1:]
            if sess.grammar is not None:
                masked = mask_rows(sess.grammar, last, [])
                last, dead = masked.logits, masked.dead_row is not None
            if not dead:
                nxt = self._pick(last[0], sess)
                gap = logit_gaps(last)[0]
                if sess.top_logprobs >= 0:
                    lps = token_logprobs(last, sess.cfg, [nxt], sess.top_logprobs)
                if sess.grammar is not None and not sess.grammar.follow_allowed([nxt], len(call.token_ids)):
                    nxt, lps, dead = None, [], True
        if not self._measured:  # the cache's real element type and layout (the estimate came from the config)
            self.kv.measure(kv.bytes_per_token(sess.cache))
            self._measured = True
        self.kv.insert(sess)  # NOT_FOUND when released while it ran (or named twice in one batch): nothing is kept
        return PrefillOutcome(sess.session_id, nxt, gap, sess.cache_len, lps, dead, sess.cached_tokens)

    def _finish_verify(self, row: _Row, rows: torch.Tensor) -> VerifyOutcome:
        """``rows``: [γ+1, V] logits; row i scores draft_ids[i], row γ the
        bonus (or, when every drafted token is accepted, the post token)."""
        sess, call = row.sess, row.call
        assert isinstance(call, VerifyCall)
        draft_ids, draft_q, post_id = call.draft_ids, call.draft_q, call.post_id
        gamma = len(draft_ids)
        dead: int | None = None
        if sess.grammar is not None:  # the constrained p at every row (target_service/constrained.py)
            masked = mask_rows(sess.grammar, rows, draft_ids)
            rows, dead = masked.logits, masked.dead_row
            if dead is not None:  # no token allowed at row `dead`: verify the span before it, then stop
                draft_ids, draft_q, post_id = draft_ids[:dead], draft_q[:dead], None
                rows = rows[: dead + 1]
        if sess.cfg.greedy:
            res = greedy_verify(draft_ids, argmax_rows(rows), post_id)
        else:
            # γ = 0 without a post token: one multinomial draw from row 0, as plain sampling
            probs = process_logits(rows, sess.cfg)
            post = None if post_id is None else (post_id, call.post_q)
            res = rejection_sample(draft_ids, draft_q, probs, sess.generator, post)
        dead_end = dead is not None and res.num_accepted == dead
        keep = sess.cache_len + len(call.new_ids) + res.num_accepted
        written = sess.cache_len + len(call.new_ids) + gamma
        if written > keep:
            kv.drop_last(sess.cache, written - keep)
        tokens = list(draft_ids[: res.num_accepted]) + ([] if dead_end else [res.next_token])
        if sess.grammar is not None:
            taken = sess.grammar.follow_allowed(tokens, sess.cache_len + len(call.new_ids))
            if taken < len(tokens):  # the parser refused what the mask allowed: end the sequence there
                tokens, dead_end = tokens[:taken], True
                cut = min(keep, sess.cache_len + len(call.new_ids) + taken)
                if cut < keep:
                    kv.drop_last(sess.cache, keep - cut)
                    keep = cut
                    res = VerifyResult(taken, res.next_token, False)  # only the tokens the grammar took count
        del sess.tokens[sess.cache_len :]
        sess.tokens.extend(call.new_ids)
        sess.tokens.extend(draft_ids[: res.num_accepted])
        del sess.tokens[keep:]
        sess.cache_len = keep
        emitted = rows[: len(tokens)]
        lps = token_logprobs(emitted, sess.cfg, tokens, sess.top_logprobs) if sess.top_logprobs >= 0 else []
        return VerifyOutcome(res, keep, logit_gaps(emitted) if tokens else [], lps, dead_end,
                             list(draft_ids) if call.self_drafted else [])

    def run_batch(self, calls: Sequence[Call]) -> list[tuple[Outcome | Requeue | SpecdecError | Exception, ForwardInfo]]:
        """Serves several Prefill/Verify calls (from different sessions) with one
        forward pass. Each call is validated, verified and rolled back exactly
        as on its own; a call that fails gets its own error, the others are
        unaffected. Returns (outcome or error, the forward that served it) per
        call, in order; a prefill chunk that is not its prompt's last answers
        :class:`Requeue` of the next one."""
        results: list[tuple[Outcome | Requeue | SpecdecError | Exception, ForwardInfo]] = [
            (AssertionError("not run"), ForwardInfo(0, 0)) for _ in calls
        ]
        self._store_parked()  # sessions released since the last batch: their prefixes count for this one
        self.trim.maybe_trim()  # what the last batches freed goes back to the system
        rows: list[tuple[int, _Row]] = []
        # sessions named in this batch are never evicted to make room for their batch-mates
        protect: set[str] = {c.session_id for c in calls if isinstance(c, VerifyCall)}
        seen: set[str] = set()
        reserved = 0
        new_sessions = 0
        for i, call in enumerate(calls):
            try:
                if isinstance(call, PrefillCall):
                    row = self._prepare_prefill(call, protect, reserved, new_sessions)
                    new_sessions += 1
                elif isinstance(call, PrefillChunk):
                    row = self._prepare_chunk(call)
                else:
                    if call.session_id in seen:
                        raise FailedPrecondition(f"concurrent Verify calls for session {call.session_id!r} in one batch")
                    row = self._prepare_verify(call, protect, reserved)
                    seen.add(call.session_id)  # a failed call left its session as it was
            except SpecdecError as e:
                if isinstance(call, PrefillChunk):
                    self.kv.unreserve(call.session_id)
                results[i] = (e, ForwardInfo(0, 0))
                continue
            protect.add(row.sess.session_id)
            if not row.chunked:  # a chunked prefill's prompt is held by its reservation
                reserved += len(row.ids)
            rows.append((i, row))
        if not rows:
            return results
        only = [r for _, r in rows]

        batched = len(only) > 1 and self._batchable(only)
        groups = [rows] if len(rows) == 1 or batched else [[x] for x in rows]
        while groups:
            group = groups.pop(0)
            info = ForwardInfo(len(group), sum(len(r.ids) for _, r in group))
            try:
                t0 = time.perf_counter()
                if len(group) == 1:
                    _, r = group[0]
                    logits = [self._forward(r.sess.cache, r.ids, r.keep)]
                else:
                    logits = self._forward_batch([r for _, r in group])
                self._time_forward(group, (time.perf_counter() - t0) * 1e3)
            except Exception as e:
                if len(group) > 1:  # the sessions' caches are untouched: retry the rows one by one
                    log(logger, logging.WARNING, "batched forward failed; retrying unbatched",
                        rows=len(group), error=repr(e))
                    groups = [[x] for x in group] + groups
                    continue
                err = self._forward_error(e)  # e.g. out of memory; the row's cache is suspect
                for i, r in group:
                    self._drop(r)
                    results[i] = (err, info)
                continue
            for (i, r), lg in zip(group, logits):
                try:
                    out: Outcome | Requeue
                    if r.chunked:
                        out = self._finish_chunk(r, lg)
                    elif isinstance(r.call, PrefillCall):
                        out = self._finish_prefill(r, lg)
                    else:
                        out = self._finish_verify(r, lg)
                    results[i] = (out, info)
                except SpecdecError as e:
                    if r.chunked:
                        self.kv.unreserve(r.sess.session_id)
                    results[i] = (e, info)
                except Exception as e:  # a bug: fail this call alone; its session's state is suspect
                    logger.exception("verification failed")
                    self._drop(r)
                    results[i] = (e, info)
                if isinstance(results[i][0], PrefillOutcome):
                    self._store_prefix(r.sess)  # its prompt, for requests that share it while this one runs
        return results

    def _drop(self, row: _Row) -> None:
        """A row whose forward or verification failed: its session goes (and a
        prefill's reservation), not into the prefix cache (its cache is suspect)."""
        self.kv.release(row.sess.session_id)
        if row.chunked:
            self.kv.unreserve(row.sess.session_id)

    @staticmethod
    def _forward_error(e: Exception) -> Exception:
        if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
            log(logger, logging.ERROR, "forward pass out of memory", error=repr(e))
            return ResourceExhausted("the target ran out of memory for this batch; retry")
        logger.exception("forward pass failed")
        return e

    def _one(self, call: Call) -> Outcome:
        """One call on its own; a chunked prefill runs all its chunks here."""
        out, _ = self.run_batch([call])[0]
        while isinstance(out, Requeue):
            out, _ = self.run_batch([out.call])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def prefill(
        self, token_ids: Sequence[int], cfg: SamplingConfig, sample_next: bool, rng_offset: int = 0,
        top_logprobs: int = -1, grammar: GrammarState | None = None, session_id: str = "",
    ) -> PrefillOutcome:
        out = self._one(PrefillCall(list(token_ids), cfg, sample_next, rng_offset, top_logprobs, grammar, session_id))
        assert isinstance(out, PrefillOutcome)
        return out

    def verify(
        self,
        session_id: str,
        cache_len: int,
        new_ids: Sequence[int],
        draft_ids: Sequence[int],
        draft_q: Sequence[SparseQ | None],
        post_id: int | None = None,
        post_q: SparseQ | None = None,
    ) -> VerifyOutcome:
        """Runs new_ids + draft_ids through the model in one pass and verifies the span.

        Rows of the logits used: the last new token's row scores draft_ids[0],
        ...; row γ (after the last drafted token) gives the bonus. The cache
        keeps new_ids + the accepted prefix; the next token is *not* cached
        (the caller sends it as the next round's new_ids).

        ``post_id`` (with its q, None = one-hot): a token drafted at the bonus
        position; when the whole span is accepted it is verified against row
        γ instead of sampling the bonus (``result.is_post`` when accepted). It
        is not fed into the cache, so cache_len is as without it.
        """
        out = self._one(
            VerifyCall(session_id, cache_len, list(new_ids), list(draft_ids), list(draft_q), post_id, post_q)
        )
        assert isinstance(out, VerifyOutcome)
        return out
