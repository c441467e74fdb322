"""Typed configuration of the gateway (built by gateway/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.models import DEFAULT_TARGET
from specdec.tls import TlsClientConfig


@dataclass
class GatewayConfig:
    orchestrator_address: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = pick a free port (vLLM's convention is 8000)
    # The names GET /v1/models lists and requests may give as "model" (the
    # first is the default when a request leaves it out).
    served_model_names: list[str] = field(default_factory=lambda: [DEFAULT_TARGET])
    orchestrator_tls: TlsClientConfig | None = None  # None = plaintext to the orchestrator
    # HTTPS on the gateway's own port (None = plain HTTP: TLS ends at the ingress)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA
    request_timeout_s: float = 600.0  # the Generate deadline of one request (the openai client's default)
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    max_message_bytes: int = 8 * 1024 * 1024  # gRPC messages to and from the orchestrator
    # the event loop of `specdec serve gateway`: "uvloop", "asyncio", or "auto"
    # (uvloop when importable); gateway.server.event_loop_runner picks it
    event_loop: str = "auto"
    ready_timeout_s: float = 1.0  # the orchestrator health check behind /ready
    metrics_port: int = 0  # Prometheus /metrics on its own port; 0 = off
    metrics_host: str = "127.0.0.1"
    # pass bearer tokens on over a plaintext orchestrator channel off loopback
    # (something else encrypts that hop); without it such requests get HTTP 403
    allow_plaintext_tokens: bool = False

    def plaintext_tokens(self) -> tuple[str, str]:
        """(why a request carrying a token is refused, the warning to log at
        start-up), each "" when it does not apply. The orchestrator channel is
        this gateway's own hop: plaintext off loopback refuses tokens unless
        ``allow_plaintext_tokens``. Plain HTTP on a non-loopback host only
        warns: TLS commonly ends at an ingress in front of it."""
        from specdec.auth import check_token_transport, is_loopback

        warnings = []
        if self.tls_cert is None and not is_loopback(self.host):
            warnings.append(f"the gateway serves plain HTTP on {self.host}: clients' bearer tokens are readable on "
                            "the way unless TLS ends in front of it (an ingress) or it serves --tls-cert")
        try:
            w = check_token_transport("client", self.orchestrator_address, encrypted=self.orchestrator_tls is not None,
                                      allow_plaintext=self.allow_plaintext_tokens)
        except ValueError as e:
            return str(e), "; ".join(warnings)
        return "", "; ".join(warnings + ([w] if w else []))
