"""Request guards for every gRPC server, as one ``grpc.aio`` server interceptor:

- requests that do not parse (e.g. a string field holding invalid UTF-8) get
  INVALID_ARGUMENT instead of grpc's UNKNOWN;
- bearer-token authentication (``authorization: Bearer <token>``) against a
  tokens file that is re-read when it changes (rotation without restart):
  UNAUTHENTICATED for a missing, malformed or unknown token,
  PERMISSION_DENIED for a token whose scopes exclude the method;
- under mutual TLS, the client certificate's identity (CN or a DNS SAN)
  against the server's allow-list (``client_names``): PERMISSION_DENIED for
  a certificate of another identity, UNAUTHENTICATED without one;
- a per-client-identity limit on concurrent calls (RESOURCE_EXHAUSTED);
- a call whose deadline has already passed does no work (DEADLINE_EXCEEDED).

Health and reflection stay open unless ``protect_health``.

Bearer tokens never travel in plaintext by accident: :func:`check_token_transport`
refuses a plaintext hop that carries them (a server accepting tokens without
TLS, a client sending one over a plaintext channel) unless both ends are on
loopback or the operator passed ``--allow-plaintext-tokens`` (a mesh or proxy
that encrypts the hop), which is logged as a warning.

Tokens file: one entry per line, ``#`` comments and blank lines ignored::

    token                        # identity "token-<sha256 prefix>"
    client-name:token            # identity "client-name"
    client-name:token:Generate,Health   # only these methods (else PERMISSION_DENIED)

Scopes name a method (``Generate``), a service (``Health``,
``Orchestrator``, ``ServerReflection``), a full method path
(``/specdec.v1.Orchestrator/Generate``) or ``*``. Tokens are compared as
SHA-256 digests with ``hmac.compare_digest`` against every entry.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from specdec.errors import InvalidArgument
from specdec.logging_util import log
from specdec.tls import FileWatcher, peer_names

logger = logging.getLogger("specdec.auth")

MIN_TOKEN_CHARS = 16
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")


@dataclass(frozen=True)
class TokenEntry:
    name: str
    digest: bytes
    scopes: frozenset[str]  # empty = every method

    def allows(self, method: str) -> bool:
        if not self.scopes or "*" in self.scopes:
            return True
        service, _, name = method.lstrip("/").partition("/")
        return bool({method, name, service, service.rsplit(".", 1)[-1]} & self.scopes)


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def parse_tokens(text: str, source: str = "tokens file") -> list[TokenEntry]:
    """Parses a tokens file; raises ValueError on a malformed one."""
    entries: list[TokenEntry] = []
    seen: set[bytes] = set()
    names: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(":")
        if len(parts) > 3 or any(c.isspace() for c in line):
            raise ValueError(f"{source}:{n}: expected 'token', 'name:token' or 'name:token:scope,...'")
        if len(parts) == 1:
            name, token, scopes = "", parts[0], ""
        else:
            name, token, scopes = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
            if not name:
                raise ValueError(f"{source}:{n}: empty client name")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{source}:{n}: tokens must be at least {MIN_TOKEN_CHARS} characters")
        digest = _digest(token)
        if digest in seen:
            raise ValueError(f"{source}:{n}: duplicate token")
        name = name or f"token-{digest.hex()[:8]}"
        if name in names:
            raise ValueError(f"{source}:{n}: duplicate client name {name!r}")
        seen.add(digest)
        names.add(name)
        entries.append(TokenEntry(name, digest, frozenset(s for s in scopes.split(",") if s)))
    if not entries:
        raise ValueError(f"{source}: no tokens")
    return entries


class TokenStore:
    """Tokens from a file, reloaded when its (size, mtime, inode) changes --
    checked on every lookup, which costs one ``stat`` -- or on ``reload()``
    (SIGHUP). A reload that fails keeps the previous tokens and logs why."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        self._watch = FileWatcher([self.path])
        self._entries = parse_tokens(self._read(), str(self.path))  # errors here stop startup
        self.reloads = 0

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read tokens file {str(self.path)!r}: {e.strerror or e}") from None

    def reload(self, force: bool = True) -> bool:
        """Re-reads the file (when forced or changed); True when tokens changed."""
        if not self._watch.changed() and not force:
            return False
        with self._lock:
            try:
                entries = parse_tokens(self._read(), str(self.path))
            except ValueError as e:
                log(logger, logging.ERROR, "tokens file reload failed; keeping the previous tokens", error=str(e))
                return False
            self._entries = entries
            self.reloads += 1
        log(logger, logging.INFO, "tokens reloaded", clients=len(entries))
        return True

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry of ``token`` (None if unknown), comparing in constant time
        against every entry."""
        self.reload(force=False)
        given = _digest(token)
        found: TokenEntry | None = None
        for e in self._entries:
            if hmac.compare_digest(given, e.digest) and found is None:
                found = e
        return found


PLAINTEXT_FLAG = "--allow-plaintext-tokens"


def host_of(address: str) -> str:
    """The host of a gRPC target or bind address (``host:port``, ``[v6]:port``,
    ``dns:///host:port``, ``ipv4:``/``ipv6:`` schemes; ``unix:`` paths give
    ``localhost``)."""
    a = address.strip()
    if a.startswith(("unix:", "unix-abstract:")):
        return "localhost"
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if a.startswith(scheme):
            a = a[len(scheme):]
            break
    if "/" in a:  # dns://authority/host:port
        a = a.rsplit("/", 1)[1]
    a = a.split(",", 1)[0]
    if a.startswith("["):
        return a[1:].split("]", 1)[0]
    if a.count(":") == 1:
        return a.rsplit(":", 1)[0]
    return a  # a bare host, or an IPv6 address without a port


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host or a gRPC address) stays on this machine:
    a loopback IP, ``localhost`` or a unix socket. Names are not resolved, so
    any other name counts as remote; ``0.0.0.0`` and ``::`` (every interface)
    are not loopback."""
    host = host_of(address).lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token_transport(role: str, address: str, *, encrypted: bool, allow_plaintext: bool) -> str:
    """Refuses (ValueError) a hop where bearer tokens would travel in
    plaintext: ``role`` "server" accepting tokens on the bind ``address``, or
    "client" sending one to ``address``, without TLS and off loopback, unless
    ``allow_plaintext``. Returns the warning to log ("" when the hop is safe)."""
    if encrypted or is_loopback(address):
        return ""
    if role == "server":
        what = f"bearer tokens would be accepted in plaintext on {address}"
        fix = "serve TLS (--tls-cert/--tls-key), bind to loopback"
    else:
        what = f"a bearer token would be sent in plaintext to {address}"
        fix = "use TLS (the server's CA: --tls-ca, tls_ca=), dial a loopback address"
    if not allow_plaintext:
        raise ValueError(f"{what}: {fix}, or pass {PLAINTEXT_FLAG} when something else encrypts this hop "
                         "(a service mesh, a TLS-terminating proxy)")
    return f"{what} ({PLAINTEXT_FLAG}): anyone on the network path can read and replay them"


def bearer_metadata(token: str | None, address: str, *, encrypted: bool, allow_plaintext: bool = False,
                    log_to: logging.Logger | None = None) -> list[tuple[str, str]] | None:
    """The ``authorization`` metadata a client sends ``token`` with to
    ``address`` (None without a token), after :func:`check_token_transport`
    (ValueError over plaintext off loopback unless ``allow_plaintext``; then
    a warning is logged)."""
    if not token:
        return None
    warning = check_token_transport("client", address, encrypted=encrypted, allow_plaintext=allow_plaintext)
    if warning:
        log(log_to or logger, logging.WARNING, warning)
    return [("authorization", f"Bearer {token}")]


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class _BadRequest:
    """What the guarded deserializer returns for bytes that do not parse."""

    error: str


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError (bad UTF-8, truncated, wrong wire type)
            return _BadRequest(str(e) or type(e).__name__)

    return parse


async def _parsed(requests: Any) -> Any:
    """A request stream whose unparsable messages (from the guarded
    deserializer) raise INVALID_ARGUMENT in the handler, where it reads them."""
    async for request in requests:
        if isinstance(request, _BadRequest):
            raise InvalidArgument(f"request could not be parsed: {request.error}")
        yield request


class ServerGuard(grpc.aio.ServerInterceptor):
    """The interceptor described in the module docstring. ``tokens`` None =
    no authentication; ``max_calls_per_client`` 0 = no per-client limit."""

    def __init__(
        self,
        tokens: TokenStore | None = None,
        *,
        protect_health: bool = False,
        max_calls_per_client: int = 0,
        log_to: logging.Logger | None = None,
    ) -> None:
        """``log_to``: the serving component's logger, which logs the calls
        this guard refuses (default ``specdec.auth``); ``on_reject(method,
        code, reason, client)`` is called for each of them too (the
        orchestrator counts them with its requests)."""
        self.logger = log_to or logger
        self.on_reject: Callable[[str, grpc.StatusCode, str, str], None] | None = None
        self.tokens = tokens
        self.protect_health = protect_health
        self.max_calls_per_client = max_calls_per_client
        self.active: Counter[str] = Counter()  # identity -> calls in flight (limited methods)
        self.client_names: frozenset[str] = frozenset()  # accepted client certificate identities; empty = any

    def _is_open(self, method: str) -> bool:
        return not self.protect_health and method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES

    def _check_certificate(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """The client certificate's identity must be allowed (health and
        reflection stay open, as for tokens)."""
        if not self.client_names or self._is_open(method):
            return
        names = peer_names(context.auth_context() or {})
        if not names:
            raise _Reject(grpc.StatusCode.UNAUTHENTICATED, "this service requires a client certificate")
        if not self.client_names & set(names):
            raise _Reject(grpc.StatusCode.PERMISSION_DENIED,
                          f"client certificate {names[0]!r} may not call {method} "
                          f"(allowed: {', '.join(sorted(self.client_names))})")

    def _identity(self, context: grpc.aio.ServicerContext, method: str) -> str | None:
        """Authenticates the call; returns the client identity (None for an
        open method without authentication)."""
        self._check_certificate(context, method)
        if self.tokens is None or self._is_open(method):
            return None
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if not values:
            raise _Reject(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = str(values[0]).strip().partition(" ")
        token = token.strip()
        if len(values) > 1 or scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
            raise _Reject(grpc.StatusCode.UNAUTHENTICATED, "malformed authorization metadata; expected 'Bearer <token>'")
        entry = self.tokens.lookup(token)
        if entry is None:
            raise _Reject(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        if not entry.allows(method):
            raise _Reject(grpc.StatusCode.PERMISSION_DENIED, f"client {entry.name!r} may not call {method}")
        return entry.name

    def identify(self, context: grpc.aio.ServicerContext) -> str:
        """Who is calling, for logs: the bearer token's client name when it
        is valid, else the client certificate's subject, else the peer
        address. Never raises."""
        if self.tokens is not None:
            for k, v in context.invocation_metadata() or ():
                if k == "authorization":
                    scheme, _, token = str(v).strip().partition(" ")
                    entry = self.tokens.lookup(token.strip()) if scheme.lower() == "bearer" else None
                    if entry is not None:
                        return entry.name
                    break
        try:
            return self._peer_identity(context)
        except Exception:
            return "unknown"

    @staticmethod
    def _peer_identity(context: grpc.aio.ServicerContext) -> str:
        """Without a token: the client certificate's subject if any, else the
        peer's address without its port."""
        auth = context.auth_context() or {}
        for key in ("x509_common_name", "x509_subject"):
            if auth.get(key):
                return f"cert:{auth[key][0].decode(errors='replace')}"
        peer = context.peer() or "unknown"
        return "peer:" + (peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer)

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext, method: str) -> str | None:
        """Runs every check; returns the identity whose call slot is taken
        (release it with ``_leave``) or None."""
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise _Reject(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline expired before the call started")
            identity = self._identity(context, method)
            if isinstance(request, _BadRequest):
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, f"request could not be parsed: {request.error}")
            if self.max_calls_per_client <= 0 or self._is_open(method):
                return None
            identity = identity or self._peer_identity(context)
            if self.active[identity] >= self.max_calls_per_client:
                raise _Reject(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {identity!r} has {self.max_calls_per_client} calls in flight (the limit)",
                )
            self.active[identity] += 1
            return identity
        except _Reject as r:
            client = self.identify(context)
            log(self.logger, logging.INFO, "request rejected", method=method, code=r.code.name, reason=r.message,
                client=client)
            if self.on_reject is not None:
                try:
                    self.on_reject(method, r.code, r.message, client)
                except Exception:  # accounting must never change the answer
                    self.logger.exception("rejection hook failed")
            await context.abort(r.code, r.message)
        raise AssertionError("unreachable")

    def _leave(self, identity: str | None) -> None:
        if identity is not None:
            self.active[identity] -= 1
            if self.active[identity] <= 0:
                del self.active[identity]

    def _wrap(self, behavior: Callable[..., Any], method: str, unary_request: bool) -> Callable[..., Any]:
        guard = self

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                identity = await guard._admit(request if unary_request else None, context, method)
                try:
                    async for item in behavior(request if unary_request else _parsed(request), context):
                        yield item
                finally:
                    guard._leave(identity)

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            identity = await guard._admit(request if unary_request else None, context, method)
            try:
                result = behavior(request if unary_request else _parsed(request), context)
                return await result if inspect.isawaitable(result) else result
            finally:
                guard._leave(identity)

        return unary

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary"
        )
        behavior = getattr(handler, kind)
        unary_request = not handler.request_streaming
        changes: dict[str, Any] = {kind: self._wrap(behavior, method, unary_request)}
        changes["request_deserializer"] = _safe_deserializer(handler.request_deserializer)
        return handler._replace(**changes)
