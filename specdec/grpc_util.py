"""Shared gRPC plumbing: server construction (health, reflection, limits),
error translation, and the single-threaded model worker that keeps heavy
compute off the asyncio event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NoReturn, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.auth import ServerGuard
from specdec.errors import SpecdecError
from specdec.logging_util import log
from specdec.tls import TlsServerConfig

logger = logging.getLogger("specdec.grpc")

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_connection_age_ms", 30 * 60 * 1000),
        ("grpc.max_connection_age_grace_ms", 5 * 60 * 1000),
    ]


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer  # type: ignore[name-defined]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        for name in self.service_names:
            await self.health.set(name, status)

    service_names: Sequence[str] = ()
    health_server: grpc.aio.Server | None = None  # the plaintext health-only port, if any
    health_port: int = 0

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_full_names: Sequence[str],
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    health_port: int = 0,
    tls: TlsServerConfig | None = None,
    guard: ServerGuard | None = None,
) -> ServerHandle:
    """Builds and starts a ``grpc.aio`` server with health (NOT_SERVING until
    the caller flips it) and reflection. ``port=0`` picks a free port.
    ``health_port`` > 0 also serves the same health status, and nothing else,
    in plaintext on that port: Kubernetes' native gRPC probes cannot speak TLS.
    ``tls`` serves TLS (mutual TLS with a client CA) instead of plaintext;
    ``guard`` (default: parse errors and expired deadlines only) also
    authenticates and limits calls (see specdec.auth). Under mutual TLS the
    guard also checks the client certificate's identity against
    ``tls.allowed_clients`` (the defaults of specdec.tls.DEFAULT_CLIENT_ALLOW)."""
    guard = guard or ServerGuard()
    if tls is not None:
        guard.client_names = tls.allowed_clients(service_full_names)
    server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=[guard])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_full_names) + [
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    await server.start()
    handle = ServerHandle(server=server, port=bound, health=health_servicer)
    handle.service_names = list(service_full_names)
    if health_port > 0:
        hs = grpc.aio.server(options=server_options())
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, hs)
        handle.health_port = hs.add_insecure_port(f"{host}:{health_port}")
        if handle.health_port == 0:
            await server.stop(0)
            raise RuntimeError(f"could not bind the health port {host}:{health_port}")
        await hs.start()
        handle.health_server = hs
    await handle.set_serving(False)
    return handle


def translate_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorator for unary servicer methods: maps ``SpecdecError`` to its gRPC
    status and logs anything unexpected as INTERNAL (never crashes the server)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except Exception as e:
            await abort_with(context, e, method.__name__)

    return wrapper


async def abort_with(context: grpc.aio.ServicerContext, e: Exception, method: str) -> NoReturn:
    """Ends the call for ``e``: a ``SpecdecError`` with its gRPC status, an
    abort as it is, anything unexpected as INTERNAL (logged; never crashes
    the server). For servicer methods that handle their own errors, such as
    a stream that answers many requests."""
    if isinstance(e, SpecdecError):
        await context.abort(e.code, e.message)
    if isinstance(e, grpc.aio.AbortError):
        raise e
    log(logger, logging.ERROR, "unhandled error", method=method, error=repr(e))
    logger.exception("unhandled error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
    raise AssertionError("unreachable")


@dataclass
class WorkTiming:
    queue_ms: float
    compute_ms: float
    queue_depth: int = 0  # jobs already pending when this one was submitted
    batch_size: int = 1  # rows (calls) in the forward pass that served this job
    batch_tokens: int = 0  # real input tokens in that forward pass (0 = not a forward)


class ModelWorker:
    """Runs model compute on one dedicated thread, off the event loop, one job
    at a time (torch and onnxruntime already use all cores per call). Reports
    the time each job waited and ran. A batching scheduler can replace it
    without changing callers."""

    def __init__(self, name: str, max_queue: int = 256) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending = 0
        self._lock = threading.Lock()
        self._max_queue = max_queue

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> tuple[T, WorkTiming]:
        from specdec.errors import ResourceExhausted

        with self._lock:
            if self._pending >= self._max_queue:
                raise ResourceExhausted(f"model queue is full ({self._max_queue} pending requests)")
            depth = self._pending
            self._pending += 1
        submitted = time.perf_counter()

        def job() -> tuple[T, float, float]:
            started = time.perf_counter()
            result = fn(*args)
            return result, started, time.perf_counter()

        try:
            loop = asyncio.get_running_loop()
            result, started, ended = await loop.run_in_executor(self._pool, job)
        finally:
            with self._lock:
                self._pending -= 1
        return result, WorkTiming((started - submitted) * 1e3, (ended - started) * 1e3, depth)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def drain(handle: ServerHandle, in_flight: Callable[[], int], timeout_s: float, service: str) -> None:
    """Graceful shutdown, step one: health goes NOT_SERVING (Kubernetes
    readiness and the orchestrator's routing stop sending new work; the
    servicer refuses new sessions), then waits until ``in_flight()`` is 0 or
    ``timeout_s`` passed. The caller then stops the server with a grace."""
    await handle.set_serving(False)
    started = time.monotonic()
    left = in_flight()
    log(logger, logging.INFO, "draining", service=service, in_flight=left, timeout_s=timeout_s)
    while left and time.monotonic() - started < timeout_s:
        await asyncio.sleep(0.1)
        left = in_flight()
    log(logger, logging.INFO if not left else logging.WARNING, "drained" if not left else "drain timed out",
        service=service, in_flight=left, waited_s=round(time.monotonic() - started, 3))
