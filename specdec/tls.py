"""Transport security: typed TLS settings for servers and channels, and the
loaders that turn them into gRPC credentials.

Every setting is a file path (PEM), handed down from the CLI in each
service's config dataclass; nothing here reads the environment. A server
re-reads its certificate, key and client CA when those files change (checked
at each new TLS handshake), so a rotated Kubernetes Secret takes effect
without a restart for new connections; a channel reads its files once, when
it is built (see docs/security.md).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc

from specdec.logging_util import log

logger = logging.getLogger("specdec.tls")


def _read(path: Path | str, what: str) -> bytes:
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {str(p)!r} is not a PEM file")
    return data


#: Under mutual TLS, the client identities (certificate CN or DNS SAN) each
#: gRPC service accepts by default: only the orchestrator may call the model
#: services. Services not listed accept any certificate from the client CA.
DEFAULT_CLIENT_ALLOW: dict[str, tuple[str, ...]] = {
    "specdec.v1.Target": ("specdec-orchestrator",),
    "specdec.v1.Draft": ("specdec-orchestrator",),
}
ANY_CLIENT = "*"


@dataclass(frozen=True)
class TlsServerConfig:
    """Server certificate and key; with ``client_ca``, clients must present a
    certificate signed by that CA (mutual TLS), whose common name or a DNS
    subject alternative name is in ``client_allow`` (None = the service's
    default, :data:`DEFAULT_CLIENT_ALLOW`; ``("*",)`` = any certificate from
    the CA)."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    client_allow: tuple[str, ...] | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def allowed_clients(self, services: Sequence[str]) -> frozenset[str]:
        """The client identities accepted by a server of ``services`` (empty:
        no check beyond the CA's signature; also without mutual TLS)."""
        if not self.mutual:
            return frozenset()
        names = self.client_allow
        if names is None:
            names = tuple(n for s in services for n in DEFAULT_CLIENT_ALLOW.get(s, (ANY_CLIENT,)))
        return frozenset() if ANY_CLIENT in names or not names else frozenset(names)

    def files(self) -> list[Path]:
        return [Path(p).expanduser() for p in (self.cert, self.key, self.client_ca) if p is not None]

    def certificate_configuration(self) -> Any:
        """Reads and checks the files (the key must match the certificate)."""
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(Path(self.cert).expanduser(),
                                                                   Path(self.key).expanduser())
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TLS certificate {str(self.cert)!r} and key {str(self.key)!r} do not load: {e}") from None
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        ca = _read(self.client_ca, "client CA") if self.client_ca is not None else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up changed files at the next handshake;
        a change that does not load keeps the previous files (logged)."""
        watcher = FileWatcher(self.files())
        initial = self.certificate_configuration()

        def fetch() -> Any:
            if not watcher.changed():
                return None
            try:
                config = self.certificate_configuration()
            except ValueError as e:
                log(logger, logging.ERROR, "TLS files changed but do not load; keeping the previous ones", error=str(e))
                return None
            log(logger, logging.INFO, "TLS certificate reloaded", cert=str(self.cert))
            return config

        return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=self.mutual)


class FileWatcher:
    """Tells when any of some files changed (size, mtime or inode; symlinks
    followed, so a Kubernetes Secret's atomic swap counts)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._lock = threading.Lock()
        self._stamp = self._stat()

    def _stat(self) -> list[tuple[int, int, int] | None]:
        out: list[tuple[int, int, int] | None] = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_size, st.st_mtime_ns, st.st_ino))
            except OSError:
                out.append(None)
        return out

    def changed(self) -> bool:
        stamp = self._stat()
        with self._lock:
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            return True


@dataclass(frozen=True)
class TlsClientConfig:
    """How a client verifies a server (``ca``; None = the system roots) and,
    for mutual TLS, the certificate it presents (``cert`` + ``key``).
    ``server_name`` overrides the name checked against the server
    certificate (when dialling by IP or through a name the cert lacks)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS client certificate needs both cert and key")

    def credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "TLS CA") if self.ca is not None else None
        cert = _read(self.cert, "TLS client certificate") if self.cert is not None else None
        key = _read(self.key, "TLS client key") if self.key is not None else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls(cert: Path | str | None, key: Path | str | None, client_ca: Path | str | None = None,
               client_allow: Sequence[str] | None = None) -> TlsServerConfig | None:
    """Builds the server settings from the ``--tls-*`` flags (None = plaintext).
    ``client_allow``: the ``--tls-client-allow`` values (comma-separated
    lists allowed; None = the service's default)."""
    if client_allow is not None:
        client_allow = tuple(n.strip() for v in client_allow for n in v.split(",") if n.strip())
        if not client_allow:
            raise ValueError("--tls-client-allow needs a name (or '*')")
        if client_ca is None:
            raise ValueError("--tls-client-allow needs --tls-client-ca (mutual TLS)")
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return TlsServerConfig(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None,
                           tuple(client_allow) if client_allow is not None else None)


def peer_names(auth_context: dict[str, Sequence[bytes]]) -> list[str]:
    """The verified client certificate's common name and DNS subject
    alternative names, from a gRPC call's ``auth_context()`` ([] without one)."""
    names = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names += [v.decode(errors="replace") for v in auth_context.get(key, ())]
    return names


def client_tls(
    ca: Path | str | None,
    cert: Path | str | None = None,
    key: Path | str | None = None,
    server_name: str = "",
) -> TlsClientConfig | None:
    """Builds client settings from flags; TLS is on when a CA or a client
    certificate is given (None = plaintext)."""
    if ca is None and cert is None and key is None:
        if server_name:
            raise ValueError("a TLS server name override needs a CA (TLS is off)")
        return None
    return TlsClientConfig(
        Path(ca) if ca is not None else None,
        Path(cert) if cert is not None else None,
        Path(key) if key is not None else None,
        server_name,
    )


def aio_channel(address: str, tls: TlsClientConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=list(options) + tls.channel_options())


def sync_channel(address: str, tls: TlsClientConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=list(options) + tls.channel_options())
