"""The gateway's lifecycle: the orchestrator channel, uvicorn serving the
Starlette app on a socket bound here (port 0 picks a free one), the
Prometheus endpoint, and drain/stop for ``specdec serve gateway``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Iterator

import uvicorn

from gateway.app import Gateway
from gateway.config import GatewayConfig
from specdec.grpc_util import channel_options
from specdec.logging_util import log
from specdec.metrics import serve_metrics
from specdec.tls import aio_channel

logger = logging.getLogger("specdec.gateway")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: ``serve_forever`` (specdec.service_cli) owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


@dataclass
class GatewayServer:
    gateway: Gateway
    server: _Uvicorn
    task: "asyncio.Task[None]"
    channel: Any
    port: int
    metrics_port: int | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.gateway.cfg.tls_cert else "http"
        host = self.gateway.cfg.host if self.gateway.cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{scheme}://{host}:{self.port}"

    async def drain(self, timeout_s: float) -> None:
        """/ready answers 503 and new requests get 503; requests in flight run
        until they end (at most ``timeout_s``)."""
        self.gateway.draining = True
        deadline = time.monotonic() + timeout_s
        while self.gateway.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log(logger, logging.INFO, "gateway drained", active=self.gateway.active)

    async def stop(self, grace: float | None = 5.0) -> None:
        self.server.config.timeout_graceful_shutdown = int(grace or 0) or None
        self.server.should_exit = True
        if grace == 0:
            self.server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.channel.close()


def event_loop_runner(config: GatewayConfig) -> Callable[[Coroutine[Any, Any, None]], None]:
    """What runs ``specdec serve gateway``'s loop: ``uvloop.run`` for
    ``event_loop`` "uvloop", and for "auto" when uvloop is importable (it
    cuts the event loop's share of each request and each streamed chunk,
    docs/benchmarks.md, gateway overhead); else ``asyncio.run``. grpc.aio
    runs on either (tests/test_gateway.py runs the gateway on both)."""
    if config.event_loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event_loop must be auto, uvloop or asyncio, got {config.event_loop!r}")
    if config.event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if config.event_loop == "uvloop":
                raise
            log(logger, logging.INFO, "uvloop is not installed: the gateway runs on asyncio's event loop")
        else:
            return uvloop.run
    return asyncio.run


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket. It is made with proto IPPROTO_TCP, not 0:
    asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP,
    and without it every keep-alive response waited out the client's
    delayed ACK (Nagle): 40 ms per request (docs/benchmarks.md, gateway
    overhead)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def start(config: GatewayConfig) -> GatewayServer:
    """Opens the orchestrator channel and serves HTTP until stopped."""
    channel = aio_channel(config.orchestrator_address, config.orchestrator_tls, channel_options(config.max_message_bytes))
    gateway = Gateway(config, channel)
    if gateway.token_warning:
        log(logger, logging.WARNING, gateway.token_warning)
    if gateway.token_refusal:
        log(logger, logging.WARNING, "requests carrying bearer tokens will be refused (HTTP 403)",
            reason=gateway.token_refusal)
    tls: dict[str, Any] = {}
    if config.tls_cert:
        tls = {"ssl_certfile": str(config.tls_cert), "ssl_keyfile": str(config.tls_key)}
        if config.tls_client_ca:
            tls.update(ssl_ca_certs=str(config.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    ucfg = uvicorn.Config(gateway.app(), log_config=None, access_log=False, lifespan="off", **tls)
    server = _Uvicorn(ucfg)
    sock = _bind(config.host, config.port)
    port = int(sock.getsockname()[1])
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("the gateway stopped during start-up")
        await asyncio.sleep(0.01)
    metrics_port = serve_metrics(gateway.metrics.registry, config.metrics_port, config.metrics_host)
    log(logger, logging.INFO, "gateway listening", port=port, orchestrator=config.orchestrator_address,
        models=config.served_model_names)
    return GatewayServer(gateway, server, task, channel, port, metrics_port)
