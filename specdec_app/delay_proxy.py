"""A TCP proxy that adds a fixed network delay: a stand-in for the link
between machines when every service runs on one host.

Every chunk read from either side is written to the other side ``rtt / 2``
after it was read (added round-trip time = 2 × one-way delay). Each
direction has a reader task that timestamps chunks into a queue and a writer
task that sleeps until timestamp + delay and writes them in order, so bytes
keep their order, pipelined messages overlap the delay as they would on a
real link, and the proxy adds no throughput limit of its own (only the real
sockets' backpressure). TCP_NODELAY is set on both sockets so that small
frames are not held back by Nagle's algorithm. It knows nothing about gRPC:
HTTP/2 passes through byte for byte.

The delay is a lower bound: asyncio's timers wake on epoll's millisecond
ticks, so each hop is late by up to about 1 ms, and the proxy's own hop costs
a few tenths of a millisecond. On a 2-core VM a TCP ping-pong through a 10 ms
proxy took 10.8 ms and a gRPC health Check 12 ms more than direct: measure it
where it matters (scripts/bench_topology.py records each proxy's measured
round trip beside the nominal one).

    proxy = await start_delay_proxy("127.0.0.1:0", "127.0.0.1:50053", rtt_ms=2)
    ... connect to proxy.address ...
    await proxy.close()

or as a process (prints ``{"address": "127.0.0.1:PORT", ...}`` once it
listens; runs until SIGTERM/SIGINT):

    python -m specdec_app.delay_proxy --listen 127.0.0.1:0 --upstream 127.0.0.1:50053 --rtt-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
from collections.abc import Sequence

CHUNK = 1 << 16


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) → (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _read_into(reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
    """Timestamps every chunk as it arrives; an empty chunk marks EOF."""
    loop = asyncio.get_running_loop()
    while True:
        data = await reader.read(CHUNK)
        queue.put_nowait((loop.time(), data))
        if not data:
            return


async def _write_from(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Writes each chunk once ``delay_s`` has passed since it was read;
    passes EOF on as a half-close."""
    loop = asyncio.get_running_loop()
    while True:
        t, data = await queue.get()
        deadline = t + delay_s
        while (now := loop.time()) < deadline:
            await asyncio.sleep(deadline - now)
        if not data:
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
            return
        writer.write(data)
        await writer.drain()


async def _first_failure(tasks: list[asyncio.Task[None]]) -> None:
    """Waits for all ``tasks``; the first one to fail cancels the others and
    its error is raised."""
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """One direction: a reader task and a writer task joined by a queue (the
    reader ends first, at EOF; the writer then empties the queue)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    await _first_failure([asyncio.create_task(_read_into(reader, queue)),
                          asyncio.create_task(_write_from(queue, writer, delay_s))])


class DelayProxy:
    """A delay proxy; ``address`` (host:port) is where clients connect once
    ``start_delay_proxy`` has returned it."""

    def __init__(self, upstream: tuple[str, int], rtt_ms: float) -> None:
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        self.upstream = upstream
        self.rtt_ms = rtt_ms
        self.address = ""
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    async def _listen(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
            _nodelay(client_w)
            _nodelay(upstream_w)
            # both directions run to EOF; a connection error in either ends both
            await _first_failure([asyncio.create_task(_pipe(client_r, upstream_w, self.one_way_s)),
                                  asyncio.create_task(_pipe(upstream_r, client_w, self.one_way_s))])
        except OSError:
            pass  # refused, reset or broken: both sides are closed below; other connections go on
        except asyncio.CancelledError:
            pass  # close(): this task belongs to asyncio's server, which expects it to end normally
        finally:
            writers = [w for w in (client_w, upstream_w) if w is not None]
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            self._connections.discard(task)

    async def close(self) -> None:
        """Stops listening and closes every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


async def start_delay_proxy(listen: str, upstream: str, rtt_ms: float) -> DelayProxy:
    """Listens on ``listen`` (port 0 = any free port) and forwards every
    connection to ``upstream`` with ``rtt_ms / 2`` added in each direction."""
    proxy = DelayProxy(split_address(upstream), rtt_ms)
    await proxy._listen(*split_address(listen))
    return proxy


async def _run(listen: str, upstream: str, rtt_ms: float) -> None:
    proxy = await start_delay_proxy(listen, upstream, rtt_ms)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"address": proxy.address, "upstream": upstream, "rtt_ms": rtt_ms}), flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec_app.delay_proxy",
                                description="TCP proxy adding a fixed delay (RTT/2 each way) to every byte.")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0 = any free port)")
    p.add_argument("--upstream", required=True, help="host:port to forward to")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time in ms (half each way)")
    a = p.parse_args(argv)
    try:
        asyncio.run(_run(a.listen, a.upstream, a.rtt_ms))
    except ValueError as e:
        print(f"delay_proxy: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
