"""Domain errors that map one-to-one onto gRPC status codes.

Domain code raises these; servicers translate them with
``specdec.grpc_util.translate_errors`` (and ``from_rpc_error`` maps a
client-side RpcError back).
Keeping the mapping here lets the engines stay free of gRPC imports.
"""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecdecError):
    code = grpc.StatusCode.CANCELLED


class Internal(SpecdecError):
    """A server fault (a bug, corrupt weights, non-finite logits): the
    request did nothing wrong, but the replica is not gone either. Neither
    backs a replica off nor triggers a rebuild (docs/reliability.md)."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SpecdecError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted, Unavailable,
                DeadlineExceeded, Cancelled, Internal)
}


def from_rpc_error(err: grpc.RpcError, service: str) -> SpecdecError:
    """Maps a downstream RpcError onto the domain error with the same code.

    Only UNAVAILABLE (which gRPC also reports for a refused, reset or lost
    connection) becomes :class:`Unavailable`, the one error that counts
    against a replica. Every status without a class of its own (INTERNAL,
    UNKNOWN, DATA_LOSS, UNIMPLEMENTED, PERMISSION_DENIED, ...) is a fault on
    the server's side: :class:`Internal`, keeping the code it came with."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, Internal)
    e = cls(f"{service}: {details}")
    e.code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.INTERNAL
    return e
