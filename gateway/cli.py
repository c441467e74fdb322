"""The gateway's flags and config builder (``specdec serve gateway``;
``specdec up`` adds them under ``--gateway-*``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from specdec.models import DEFAULT_TARGET
from specdec.service_cli import DEFAULT_PORTS, FlagSet, cli_error, client_tls, serve_command

SERVICE = "gateway"


def add_arguments(p: argparse._ActionsContainer, prefix: str = "") -> FlagSet:
    """The gateway's own flags (``prefix`` under ``specdec up``)."""
    f = FlagSet(p, prefix)
    f.add("served-model-name", default=None, forward=False,
          help="comma-separated model names GET /v1/models lists and requests may name (the first is the "
               f"default; default: the target model, {DEFAULT_TARGET})")
    f.add("request-timeout", type=float, default=600.0, help="seconds one request may take (its Generate deadline)")
    f.add("max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get HTTP 413")
    f.add("event-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
          help="the gateway's event loop: uvloop (faster per request and per streamed chunk), asyncio's own, or "
               "auto (uvloop when it is installed)")
    return f


def add_serve_arguments(p: argparse._ActionsContainer) -> None:
    """Everything ``specdec serve gateway`` takes besides the common server flags."""
    p.add_argument("--orchestrator-address", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}",
                   help="the orchestrator's gRPC address (host:port, or dns:///name:port)")
    p.add_argument("--orchestrator-ca", type=Path, default=None, help="CA of the orchestrator's certificate; enables TLS")
    p.add_argument("--orchestrator-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    p.add_argument("--orchestrator-key", type=Path, default=None, help="key of --orchestrator-cert")
    p.add_argument("--orchestrator-server-name", default="", help="name checked against the orchestrator's certificate")
    p.add_argument("--allow-plaintext-tokens", action="store_true",
                   help="pass Authorization headers on although plain HTTP on a non-loopback --host or a plaintext "
                        "non-loopback orchestrator channel carries them (a mesh or proxy encrypts the hop; logged). "
                        "Without it such requests get HTTP 403")
    add_arguments(p)


def config_from_args(a: argparse.Namespace, port: int) -> GatewayConfig:
    names = [n.strip() for n in (a.served_model_name or DEFAULT_TARGET).split(",") if n.strip()]
    if not names:
        raise cli_error("--served-model-name: at least one name is required")
    if a.request_timeout <= 0:
        raise cli_error("--request-timeout must be positive")
    if a.max_body_bytes < 1024:
        raise cli_error("--max-body-bytes must be at least 1024")
    if a.health_port:
        raise cli_error("--health-port: the gateway serves /health and /ready on its HTTP port")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise cli_error("--tls-cert and --tls-key go together")
    if a.tls_client_ca and not a.tls_cert:
        raise cli_error("--tls-client-ca needs --tls-cert and --tls-key")
    return GatewayConfig(
        orchestrator_address=a.orchestrator_address, host=a.host, port=port, served_model_names=names,
        orchestrator_tls=client_tls(a.orchestrator_ca, a.orchestrator_cert, a.orchestrator_key,
                                    a.orchestrator_server_name),
        tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
        request_timeout_s=a.request_timeout, max_body_bytes=a.max_body_bytes, event_loop=a.event_loop,
        metrics_port=a.metrics_port, metrics_host=a.metrics_host, allow_plaintext_tokens=a.allow_plaintext_tokens,
    )


def add_serve_command(sub: Any) -> None:
    """``specdec serve gateway``."""
    serve_command(sub, SERVICE, "the OpenAI-compatible HTTP API (chat, completions, SSE) in front of the orchestrator",
                  add_serve_arguments, "gateway.server", config_from_args)
