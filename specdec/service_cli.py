"""Command-line plumbing that every service shares.

Each service owns its flags and its config builder (``<service>/cli.py``);
this module gives them the common pieces: :class:`FlagSet` (a service's flags,
added to a parser under an optional prefix and rebuilt into the argv of
``specdec serve <service>`` from parsed values, so that ``specdec up`` never
lists a child's flags by hand), the flags every server takes, TLS flags, and
the serve-until-signalled loop with its drain.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

# The ports the services listen on by default (``specdec serve`` and ``up``);
# the gateway's is HTTP (vLLM's convention).
DEFAULT_PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053, "gateway": 8000}


def cli_error(message: str) -> SystemExit:
    """The one-line error a bad flag gets (``raise cli_error(...)``)."""
    return SystemExit(f"specdec: {message}")


class FlagSet:
    """The flags one service owns on one parser.

    ``add("max-span", dest="target_max_span", ...)`` adds ``--{prefix}max-span``;
    :meth:`argv` turns the parsed values back into the unprefixed flags that
    ``specdec serve <service>`` takes. Flags added with ``prefixed=False`` keep
    their name under any prefix; ``forward=False`` keeps a flag out of
    :meth:`argv` (the launcher sets it from its own wiring).
    """

    def __init__(self, container: argparse._ActionsContainer, prefix: str = "") -> None:
        self.container = container
        self.prefix = prefix
        self._flags: list[tuple[str, argparse.Action, bool]] = []

    def add(self, name: str, *, prefixed: bool = True, forward: bool = True, **kwargs: Any) -> argparse.Action:
        flag = f"--{self.prefix}{name}" if prefixed else f"--{name}"
        action = self.container.add_argument(flag, **kwargs)
        self._flags.append((name, action, forward))
        return action

    def flag_for(self, dest: str) -> str | None:
        """The flag (as the user typed it on this parser) that sets ``dest``."""
        for _, action, _ in self._flags:
            if action.dest == dest:
                return action.option_strings[0]
        return None

    def argv(self, a: argparse.Namespace) -> list[str]:
        """The forwarded flags' values as unprefixed ``--name value`` arguments."""
        out: list[str] = []
        for name, action, forward in self._flags:
            value = getattr(a, action.dest)
            if not forward or value is None:
                continue
            if isinstance(action, argparse._StoreTrueAction):
                out += [f"--{name}"] if value else []
            elif isinstance(action, argparse.BooleanOptionalAction):
                out += [f"--{name}" if value else f"--no-{name}"]
            else:
                out += [f"--{name}", str(value)]
        return out


def add_common_flags(p: argparse.ArgumentParser) -> FlagSet:
    """Flags every server takes (``specdec serve <service>``, ``specdec up``)."""
    f = FlagSet(p)
    f.add("host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    f.add("cache-dir", type=Path, default=None, forward=False, help="model cache (default $SPECDEC_CACHE_DIR or ~/.cache/specdec)")
    f.add("log-level", default="info")
    f.add("metrics-host", default="127.0.0.1", help="bind address of the Prometheus /metrics endpoint")
    f.add("health-port", type=int, default=0, forward=False,
          help="also serve grpc.health.v1 alone, in plaintext, on this port (Kubernetes gRPC probes "
               "when the service port uses TLS); 0 = off")
    f.add("drain-timeout", type=float, default=30.0,
          help="on SIGTERM: seconds to keep serving open sessions/streams (health NOT_SERVING, "
               "new ones refused) before stopping")
    return f


def add_tls_server_flags(p: argparse._ActionsContainer) -> None:
    p.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM); with --tls-key serves TLS")
    p.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--tls-client-allow", action="append", default=None, metavar="NAME[,NAME...]",
                   help="with --tls-client-ca: accept only client certificates whose CN or a DNS SAN is one of "
                        "these names; '*' = any certificate from the CA (default: specdec-orchestrator on "
                        "target and draft, any on the orchestrator)")


def server_tls(a: argparse.Namespace) -> Any:
    """The server TLS config from the ``--tls-*`` flags (None = plaintext)."""
    from specdec.tls import server_tls as build

    try:
        return build(getattr(a, "tls_cert", None), getattr(a, "tls_key", None), getattr(a, "tls_client_ca", None),
                     getattr(a, "tls_client_allow", None))
    except ValueError as e:
        raise cli_error(str(e)) from None


def validated(cfg: Any, a: argparse.Namespace, field_dests: dict[str, str], flags_attr: str) -> Any:
    """``cfg`` after its ``validate()``; a ValueError becomes a one-line CLI
    error naming the flags (``a.<flags_attr>``, the service's FlagSet, finds
    each config field's flag by its ``dest``) instead of the config fields."""
    try:
        cfg.validate()
    except ValueError as e:
        msg = str(e)
        flags: FlagSet | None = getattr(a, flags_attr, None)
        for field_name, dest in field_dests.items():
            flag = flags.flag_for(dest) if flags is not None else None
            msg = re.sub(rf"\b{field_name}\b", flag or f"--{dest}", msg)
        raise cli_error(msg) from None
    return cfg


def client_tls(ca: Any, cert: Any = None, key: Any = None, server_name: str = "") -> Any:
    """A client TLS config (None when ``ca`` is None: plaintext)."""
    from specdec.tls import client_tls as build

    try:
        return build(ca, cert, key, server_name)
    except ValueError as e:
        raise cli_error(str(e)) from None


def serve_command(sub: Any, service: str, help: str, add_arguments: Callable[[argparse._ArgumentGroup], Any],
                      server_module: str, config_from_args: Callable[[argparse.Namespace, int], Any]) -> None:
    """``specdec serve <service>``: the flags every server takes plus the
    service's own (``add_arguments``); it builds the config with
    ``config_from_args`` and runs ``<server_module>.start`` (imported only then:
    a server module loads the service's heavy dependencies). A server module
    may define ``event_loop_runner(config)``: the function that runs the
    serve loop (``asyncio.run`` without one)."""
    p: argparse.ArgumentParser = sub.add_parser(service, help=help)
    add_common_flags(p)
    p.add_argument("--port", type=int, default=DEFAULT_PORTS[service], help="port to listen on (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    add_tls_server_flags(p.add_argument_group("transport security (default plaintext)"))
    add_arguments(p.add_argument_group(service))

    def serve(a: argparse.Namespace) -> int:
        module = importlib.import_module(server_module)
        return run_server(a, service, module.start, lambda: config_from_args(a, a.port),
                          getattr(module, "event_loop_runner", None))

    p.set_defaults(func=serve)


Server = Any  # a started server with drain(timeout) and stop(grace); optionally reload()


async def serve_forever(start: Callable[[Any], Awaitable[Server]], config: Any, drain_timeout_s: float) -> None:
    """Start a server and serve until SIGINT/SIGTERM, then drain and stop it."""
    server = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(server, "reload"):  # SIGHUP re-reads the auth tokens file
        loop.add_signal_handler(signal.SIGHUP, server.reload)
    await stop.wait()
    # Health goes NOT_SERVING first and new sessions/streams are refused; open
    # ones are served until they end (up to --drain-timeout); then in-flight
    # calls get a grace period.
    await server.drain(drain_timeout_s)
    await server.stop(grace=10.0)


def run_server(a: argparse.Namespace, service: str, start: Callable[[Any], Awaitable[Server]],
               build_config: Callable[[], Any],
               event_loop_runner: Callable[[Any], Callable[[Coroutine[Any, Any, None]], None]] | None = None) -> int:
    """The body of ``specdec serve <service>``: logging, the config, then
    serve until signalled (on the loop ``event_loop_runner(config)`` runs;
    default ``asyncio.run``)."""
    from specdec.logging_util import setup_logging

    setup_logging(a.log_level, service)
    config = build_config()
    run = event_loop_runner(config) if event_loop_runner is not None else asyncio.run
    run(serve_forever(start, config, a.drain_timeout))
    return 0
