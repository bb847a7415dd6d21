"""One mapping from domain errors to gRPC status codes, for every service.

A refusal a caller can act on is a ``ServiceError``, and its class says which status it is
answered with: a domain error subclasses the kind that fits (``class VersionStoreError(
InvalidArgument)``), and a subclass whose status differs says so in its body (``code =
grpc.StatusCode.NOT_FOUND``). Servicers answer it with ``abort(context, exc)``; in-stream
refusals (the worker's ``CommandError``) carry ``exc.code``. Anything that is not a
ServiceError is a bug: gRPC answers it UNKNOWN.
"""

from __future__ import annotations

from typing import NoReturn

import grpc


def quoted(text: str, limit: int = 64) -> str:
    """``text`` as a refusal may echo it: its repr, cut to ``limit`` characters with its length
    said, so a refusal of a 100 KB name is a short message, not one too large for the caller."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class ServiceError(Exception):
    """A request a service refuses; the message says what was wrong and what to do.

    ``code`` is the status the refusal is answered with: the class's, unless one is given for
    an error whose status depends on the case (``code=grpc.StatusCode.ALREADY_EXISTS``)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Try again (elsewhere, or later): the service is shutting down, a standby, or its store
    did not answer."""

    code = grpc.StatusCode.UNAVAILABLE


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(ServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> NoReturn:
    """End the RPC with ``error``'s status and message (raises, as ``context.abort`` does)."""
    await context.abort(error.code, str(error))
    raise AssertionError("context.abort returned")  # it always raises; this tells mypy so
