"""Where a replica list comes from and in what order a request tries it:
address parsing and discovery (static, DNS, a file), rendezvous hashing with
bounded loads for targets, the power of two choices for drafts. Plain
functions; ``orchestrator.routing`` uses them."""

from __future__ import annotations

import hashlib
import math
import random
import socket
from pathlib import Path
from typing import Sequence

DNS_PREFIX = "dns:///"
FILE_PREFIX = "file://"


# ------------------------------------------------------------------ addresses
def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addresses(spec: str | Sequence[str]) -> list[str]:
    """A comma-separated list (or a list) of entries, validated: ``host:port``,
    ``dns:///name:port`` or ``file:///path``. Empty entries are dropped."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item.startswith(FILE_PREFIX):
            if not item[len(FILE_PREFIX):]:
                raise ValueError(f"empty path in {item!r}")
        elif item.startswith(DNS_PREFIX):
            split_host_port(item[len(DNS_PREFIX):])
        elif "://" in item:
            raise ValueError(f"unsupported scheme in {item!r} (use host:port, dns:///name:port or file:///path)")
        else:
            split_host_port(item)
        out.append(item)
    return out


def resolve_dns(host: str, port: int) -> list[str]:
    """A and AAAA records of ``host`` as ``ip:port`` strings (blocking)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(str(info[4][0]), port) for info in infos})


def read_endpoints_file(path: str) -> list[str]:
    """One ``host:port`` per line; blank lines and ``#`` comments ignored (blocking)."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            split_host_port(line)
            out.append(line)
    return out


# ------------------------------------------------------------ load balancing
def _score(key: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: str, addresses: Sequence[str]) -> list[str]:
    """Highest-random-weight order of ``addresses`` for ``key``: removing a
    replica only moves the keys that were on it."""
    return sorted(addresses, key=lambda a: (_score(key, a), a), reverse=True)


def bounded_load_order(key: str, loads: dict[str, int], c: float) -> list[str]:
    """Rendezvous order with the first replica under the bounded-load capacity
    ``ceil(c × (total + 1) / n)`` moved to the front (the remaining ones keep
    their order as fallbacks)."""
    order = rendezvous_order(key, list(loads))
    if not order:
        return []
    cap = math.ceil(c * (sum(loads.values()) + 1) / len(order))
    for i, a in enumerate(order):
        if loads[a] + 1 <= cap:
            return [a] + order[:i] + order[i + 1:]
    return order  # unreachable for c ≥ 1: some replica is below the mean


def two_choices_order(loads: dict[str, int], rng: random.Random) -> list[str]:
    """Power of two choices: the less loaded of two random replicas first,
    then the rest by load (fallbacks)."""
    addrs = sorted(loads)
    if not addrs:
        return []
    if len(addrs) == 1:
        return addrs
    a, b = rng.sample(addrs, 2)
    first = a if loads[a] <= loads[b] else b
    return [first] + sorted((x for x in addrs if x != first), key=lambda x: (loads[x], x))
