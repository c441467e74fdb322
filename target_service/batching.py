"""Batch scheduler for the target model: gathers concurrent Prefill/Verify
calls from different sessions and serves them with one forward pass.

One dedicated thread owns the model. Calls wait in a bounded FIFO queue
(full → RESOURCE_EXHAUSTED). When the thread is free it takes the longest
admissible prefix of the queue as the next batch, waiting at most
``batch_window_ms`` after the oldest queued call for more to arrive (calls
that queued while the previous forward ran are batched at once: natural
batching); it does not wait when no other session has sent a call in the last
``PEER_WINDOW_S`` (a lone stream would only pay the window). After a batched forward the scheduler also waits, briefly, for
the sessions that forward served to send their next call (``regroup_ms``,
at most ``regroup_fraction`` of that forward's time): streams that decode in
lockstep would otherwise drift into alternating half-batches, because their
next calls arrive a few milliseconds apart while the window is short. Other
model jobs (load, warm-up, Release, the idle reaper) run
exclusively, in queue order, through :meth:`BatchScheduler.run`, the same
interface as :class:`specdec.grpc_util.ModelWorker`.

With ``max_batch_size = 1`` every call gets its own forward pass: the
unbatched service.

Fair scheduling of long work: the runner may answer a call with
:class:`Requeue` (a chunked prefill's next chunk, target_service/engine.py).
The job then goes to the back of the queue with that call, behind every call
that queued while its part ran, so other sessions' verify rounds are served
between two chunks of one prompt. Its caller's future is resolved only by
its last part; a part whose caller went away is still run (the runner sees
it abandoned and frees what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from specdec.errors import ResourceExhausted
from specdec.grpc_util import WorkTiming
from specdec.logging_util import log

logger = logging.getLogger("specdec.target.batching")

T = TypeVar("T")


class BatchCall(Protocol):
    """What the scheduler needs to know about a queued call."""

    @property
    def session_id(self) -> str: ...  # "" = a new session (never conflicts)

    @property
    def past_len(self) -> int: ...  # tokens already cached for the session

    @property
    def num_tokens(self) -> int: ...  # tokens the call adds in the forward


class _Info(Protocol):
    batch_size: int
    batch_tokens: int


C = TypeVar("C", bound=BatchCall)
# serves a batch: one (outcome or exception, forward info) per call, in order
Runner = Callable[[Sequence[C]], Sequence[tuple[Any, _Info]]]


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int = 16  # rows (sessions) per forward
    max_batch_tokens: int = 512  # padded input tokens per forward (rows × longest input)
    max_batch_kv_tokens: int = 65_536  # padded KV positions per forward (rows × (longest past + longest input))
    batch_window_ms: float = 2.0  # longest wait for more calls after the oldest queued one
    # longest wait after a forward for the sessions it served to come back
    # (0 = off), and at most this fraction of that forward's duration
    regroup_ms: float = 25.0
    regroup_fraction: float = 0.1

    def validate(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_batch_kv_tokens < 1:
            raise ValueError("max_batch_size, max_batch_tokens and max_batch_kv_tokens must be >= 1")
        if not 0.0 <= self.batch_window_ms <= 1000.0:
            raise ValueError(f"batch_window_ms must be in [0, 1000], got {self.batch_window_ms}")
        if not 0.0 <= self.regroup_ms <= 1000.0:
            raise ValueError(f"regroup_ms must be in [0, 1000], got {self.regroup_ms}")
        if not 0.0 <= self.regroup_fraction <= 1.0:
            raise ValueError(f"regroup_fraction must be in [0, 1], got {self.regroup_fraction}")

    def regroup_wait_s(self, forward_s: float) -> float:
        """How long to wait, after a forward of ``forward_s`` seconds, for its sessions' next calls."""
        return min(self.regroup_ms / 1e3, self.regroup_fraction * forward_s)


def admissible_prefix(calls: Sequence[BatchCall], limits: BatchLimits) -> int:
    """How many leading ``calls`` form the next batch (at least 1 when any).

    Strict FIFO (no overtaking, so nothing starves). A call joins while: the
    batch has fewer than max_batch_size rows; its session is not already in
    the batch (a second call of one session must see the first's result);
    the padded inputs (rows × longest input) stay within max_batch_tokens and
    are at least half real tokens (a long prefill does not drag short
    verifies through its padding); and the padded KV (rows × (longest past +
    longest input)) stays within max_batch_kv_tokens.
    """
    if not calls:
        return 0
    seen: set[str] = set()
    rows = real = max_n = max_past = 0
    for c in calls:
        n, past = c.num_tokens, c.past_len
        if rows:
            if rows >= limits.max_batch_size or (c.session_id and c.session_id in seen):
                break
            r, mn, mp = rows + 1, max(max_n, n), max(max_past, past)
            padded = r * mn
            if padded > limits.max_batch_tokens or 2 * (real + n) < padded or r * (mp + mn) > limits.max_batch_kv_tokens:
                break
        if c.session_id:
            seen.add(c.session_id)
        rows, real, max_n, max_past = rows + 1, real + n, max(max_n, n), max(max_past, past)
    return rows


@dataclass(frozen=True)
class Requeue:
    """A runner's answer for a call that is not finished: ``call`` is its
    next part, queued behind the work that arrived meanwhile. A part may
    define ``abandon()``: called when its caller is gone."""

    call: Any


@dataclass
class _Job(Generic[T]):
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    submitted: float
    depth: int
    call: Any = None  # a batched call, or
    fn: Callable[..., T] | None = None  # an exclusive job
    args: tuple[Any, ...] = ()
    compute_s: float = 0.0  # forward time of the parts already run (a requeued call)
    parts: int = 0  # parts run so far (0 = a fresh call)


@dataclass(frozen=True)
class BatchReport:
    """One forward pass, for metrics."""

    batch_size: int
    batch_tokens: int
    queue_depth: int  # jobs still waiting after this batch was taken


class BatchScheduler:
    """Bounded queue + one model thread that batches calls (see module doc)."""

    #: a session that sent a call this recently may send another within the window
    PEER_WINDOW_S = 2.0

    def __init__(
        self,
        name: str,
        *,
        max_queue: int = 256,
        limits: BatchLimits | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
    ) -> None:
        self.limits = limits or BatchLimits()
        self.limits.validate()
        self._max_queue = max_queue
        self._runner: Runner[Any] | None = None
        self.on_batch = on_batch
        self._queue: deque[_Job[Any]] = deque()
        self._cond = threading.Condition()
        self._pending = 0  # queued + running
        self._closed = False
        self._expected: set[str] = set()  # sessions served by the last batched forward
        self._regroup_until = 0.0  # wait for them (perf_counter) until then
        self._last_call: dict[str, float] = {}  # session -> when it last queued a call (perf_counter)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def attach(self, runner: Runner[Any]) -> None:
        """Sets the batch runner (``TargetEngine.run_batch``) once the model is loaded."""
        self._runner = runner

    @property
    def pending(self) -> int:
        return self._pending

    # ------------------------------------------------------------ submission
    def _enqueue(self, job_kwargs: dict[str, Any]) -> _Job[Any]:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closed:
                raise ResourceExhausted("the target model worker is shutting down")
            if self._pending >= self._max_queue:
                raise ResourceExhausted(f"model queue is full ({self._max_queue} pending requests)")
            now = time.perf_counter()
            job: _Job[Any] = _Job(loop.create_future(), loop, now, self._pending, **job_kwargs)
            sid = getattr(job.call, "session_id", "") if job.call is not None else ""
            if sid:
                self._last_call[sid] = now
            self._pending += 1
            self._queue.append(job)
            self._cond.notify()
        return job

    async def submit(self, call: BatchCall) -> tuple[Any, WorkTiming]:
        """Queues one call for a batched forward; returns its outcome and timing
        (raises the call's own error)."""
        job = self._enqueue({"call": call})
        return await job.future

    async def run(self, fn: Callable[..., T], *args: Any) -> tuple[T, WorkTiming]:
        """Runs ``fn(*args)`` alone on the model thread, in queue order."""
        job = self._enqueue({"fn": fn, "args": args})
        return await job.future  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in dropped:
            self._resolve(job, ResourceExhausted("the target model worker shut down"), None)

    # --------------------------------------------------------------- worker
    def _take(self) -> list[_Job[Any]] | None:
        """Blocks until the next batch (or exclusive job) is ready; None = closed."""
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                head = self._queue[0]
                if head.fn is not None or head.call is None:
                    return [self._queue.popleft()]
                deadline = head.submitted + self.limits.batch_window_ms / 1e3
                while True:
                    calls = []
                    for j in self._queue:
                        if j.fn is not None:
                            break
                        calls.append(j.call)
                    n = admissible_prefix(calls, self.limits)
                    # full: a limit stopped the prefix, or an exclusive job waits behind it
                    full = n < len(self._queue) or n >= self.limits.max_batch_size
                    now = time.perf_counter()
                    until = deadline if self._peers(now, calls) else now
                    if now < self._regroup_until and not self._expected <= {c.session_id for c in calls}:
                        until = max(until, self._regroup_until)  # the last batch's sessions are coming back
                    remaining = until - now
                    if full or remaining <= 0 or self._closed:
                        break
                    self._cond.wait(remaining)
                if self._closed:
                    return None
                batch = [self._queue.popleft() for _ in range(n)]
                for j in batch:  # a part whose caller is gone still runs: the runner frees what it holds
                    if j.parts and j.future.cancelled():
                        abandon = getattr(j.call, "abandon", None)
                        if abandon is not None:
                            abandon()
                live = [j for j in batch if j.parts or not j.future.cancelled()]
                self._pending -= len(batch) - len(live)
                if live:
                    return live

    def forget(self, session_id: str) -> None:
        """A released session sends no more calls: stop waiting for it."""
        with self._cond:
            self._last_call.pop(session_id, None)

    def _peers(self, now: float, calls: Sequence[BatchCall]) -> bool:
        """Whether a session other than those of ``calls`` sent a call in
        the last PEER_WINDOW_S, so waiting for the window may batch it
        (called with the lock held; forgets sessions gone quiet)."""
        queued = {c.session_id for c in calls}
        for sid, at in list(self._last_call.items()):
            if now - at > self.PEER_WINDOW_S:
                del self._last_call[sid]
            elif sid not in queued:
                return True
        return not all(queued)  # a new session (prefill) may be one of several arriving together

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            started = time.perf_counter()
            if jobs[0].fn is not None:
                job = jobs[0]
                try:
                    result: Any = job.fn(*job.args)
                except BaseException as e:  # delivered to the caller
                    result = e
                self._finish([(job, result, None)], started)
                continue
            if self._runner is None:
                self._finish([(j, RuntimeError("no batch runner attached"), None) for j in jobs], started)
                continue
            calls = [j.call for j in jobs]
            depth = self._pending - len(jobs)
            try:
                outs = list(self._runner(calls))
            except BaseException as e:  # a bug in the runner: fail this batch, keep serving
                logger.exception("batch runner failed")
                outs = [(e, None)] * len(jobs)
            ended = time.perf_counter()
            done: list[tuple[_Job[Any], Any, _Info | None]] = []
            with self._cond:
                for j, (out, info) in zip(jobs, outs):
                    if isinstance(out, Requeue):  # its next part waits behind what queued meanwhile
                        j.call, j.parts = out.call, j.parts + 1
                        j.compute_s += ended - started
                        self._queue.append(j)
                        self._cond.notify()
                    else:
                        done.append((j, out, info))
                for out, _ in outs:  # sessions a prefill just created are peers from now on
                    sid = getattr(out, "session_id", "")
                    if isinstance(sid, str) and sid:
                        self._last_call.setdefault(sid, ended)
                self._expected = {c.session_id for c in calls if c.session_id}
                self._regroup_until = ended + self.limits.regroup_wait_s(ended - started)
            infos = {id(info): info for _, info in outs if info is not None and info.batch_size}
            if self.on_batch is not None:
                for info in infos.values():
                    self.on_batch(BatchReport(info.batch_size, info.batch_tokens, max(0, depth)))
            self._finish(done, started)

    def _finish(self, done: list[tuple[_Job[Any], Any, _Info | None]], started: float) -> None:
        ended = time.perf_counter()
        with self._cond:
            self._pending -= len(done)
        for job, result, info in done:
            timing = WorkTiming(  # a requeued call: queue time is its wall time less all its parts' compute
                (started - job.submitted - job.compute_s) * 1e3,
                (ended - started + job.compute_s) * 1e3,
                job.depth,
                batch_size=info.batch_size if info is not None else 1,
                batch_tokens=info.batch_tokens if info is not None else 0,
            )
            self._resolve(job, result, timing)

    @staticmethod
    def _resolve(job: _Job[Any], result: Any, timing: WorkTiming | None) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result((result, timing))

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting
            log(logger, logging.DEBUG, "dropped a result for a closed event loop")
