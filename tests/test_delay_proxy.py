"""specdec_app.delay_proxy: real gRPC calls (grpc health, and a bytes echo
service for large messages and bidirectional streams) through the proxy at
RTT 0 and 20 ms arrive intact, and the 20 ms proxy adds at least 20 ms to a
unary round trip (a lower bound only: this machine's timing has no upper
bound worth asserting)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec_app.delay_proxy import DelayProxy, start_delay_proxy

MB = 1 << 20
OPTIONS = [("grpc.max_send_message_length", 16 * MB), ("grpc.max_receive_message_length", 16 * MB)]
ECHO = "test.Echo"


def _identity(b: bytes) -> bytes:
    return b


def _echo_server() -> tuple[grpc.Server, health.HealthServicer, int]:
    """grpc health plus test.Echo/Unary and test.Echo/Bidi on raw bytes."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, _identity, _identity),
        "Bidi": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (m for m in it), _identity, _identity),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(ECHO, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, port


class _Loop:
    """An asyncio loop on a thread, for the proxy (the gRPC client and server are sync)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[health.HealthServicer, int]]:
    server, servicer, port = _echo_server()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield servicer, port
    server.stop(0)


@pytest.mark.parametrize("rtt_ms", [0.0, 20.0])
def test_grpc_through_the_proxy(echo: tuple[health.HealthServicer, int], rtt_ms: float) -> None:
    servicer, port = echo
    loop = _Loop()
    proxy: DelayProxy = loop.run(start_delay_proxy("127.0.0.1:0", f"127.0.0.1:{port}", rtt_ms))
    try:
        with grpc.insecure_channel(proxy.address, options=OPTIONS) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            rtts = []
            for _ in range(5):
                t0 = time.perf_counter()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                rtts.append(time.perf_counter() - t0)
            assert min(rtts) >= rtt_ms / 1000.0, rtts

            # a few MB each way, byte for byte
            payload = os.urandom(3 * MB + 12345)
            unary = ch.unary_unary(f"/{ECHO}/Unary", request_serializer=_identity, response_deserializer=_identity)
            assert unary(payload, timeout=30) == payload

            # bidirectional stream: pipelined messages come back in order
            bidi = ch.stream_stream(f"/{ECHO}/Bidi", request_serializer=_identity, response_deserializer=_identity)
            msgs = [os.urandom(n) for n in (1, 1000, 300_000, 2 * MB, 7)]
            assert list(bidi(iter(msgs), timeout=30)) == msgs

            # server streaming: health Watch sees the current status, then a change
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=30)
            servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
            seen = []
            for resp in watch:
                seen.append(resp.status)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            watch.cancel()
            assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
            servicer.set("svc", health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
    finally:
        loop.run(proxy.close())
        loop.close()


def test_a_refused_upstream_closes_the_client_side() -> None:
    loop = _Loop()
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    proxy: DelayProxy = loop.run(start_delay_proxy("127.0.0.1:0", f"127.0.0.1:{dead}", 2.0))
    try:
        with grpc.insecure_channel(proxy.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        loop.run(proxy.close())
        loop.close()


def test_cli_prints_its_address_and_stops_on_sigterm(echo: tuple[health.HealthServicer, int]) -> None:
    _, port = echo
    proc = subprocess.Popen([sys.executable, "-m", "specdec_app.delay_proxy", "--listen", "127.0.0.1:0",
                             "--upstream", f"127.0.0.1:{port}", "--rtt-ms", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["rtt_ms"] == 2.0
        with grpc.insecure_channel(info["address"]) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
