"""What every service's gRPC server checks before a servicer runs: that the request parses, and
(with mutual TLS) that the caller's certificate holds the role the method needs.

**Decoding.** A request that is not a valid protobuf gets INVALID_ARGUMENT, on every RPC of
every service. grpcio answers a request its deserializer cannot parse with UNKNOWN ("Unexpected DecodeError"),
which a client cannot tell from a server bug. This server interceptor, installed by
``rpc.bind_server`` for every service, wraps each method's deserializer so a message that does
not parse becomes a marker instead of an exception, and wraps the method so the marker is
answered with INVALID_ARGUMENT naming the message type — for a unary request before the
servicer runs; for a request stream when the servicer reads the message that does not parse:
its read raises ``grpc.aio.AbortError`` and the status goes out at once (a unary reply) or when
the servicer's reply stream ends (a bidirectional stream: ``_RefusedStream``). Valid
messages pass through unchanged; a wrapped response stream closes the servicer's own generator
when it ends (``aclosing``), so its cleanup runs then, not at garbage collection.

**Authorization** (``authorization.py``). With TLS configured, a method that needs a role
(SubmitStep, Publish, Session) first reads the peer's certificate from the call's auth context;
a caller of another role gets PERMISSION_DENIED naming the role needed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from rlharvest.common import authorization, tls


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, ValueError, TypeError) as exc:  # ValueError: e.g. bad UTF-8
            return _Undecodable(str(exc))
    return parse


def _refusal(bad: _Undecodable) -> str:
    return f"the request is not a valid protobuf message: {bad.error}"


async def _refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(bad))


class _RefusedStream(grpc.aio.AbortError):
    """An undecodable message in a bidirectional stream. The status is set on the context and
    goes out when the servicer's response stream ends, from the RPC's own task. A servicer
    reading its requests in another task (the worker's Session) must not ``abort`` there: an
    abort racing the handler's completion can leave the client waiting until its deadline
    (grpc/grpc#28989; seen here as a rare DEADLINE_EXCEEDED under load)."""


Precheck = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


async def _no_check(context: grpc.aio.ServicerContext) -> None:
    return None


def _peer_pem(context: grpc.aio.ServicerContext) -> bytes:
    """The caller's certificate (PEM), b"" without TLS."""
    return ((context.auth_context() or {}).get("x509_pem_cert") or [b""])[0]


def _role_check(method: str) -> Precheck:
    async def authorize(context: grpc.aio.ServicerContext) -> None:
        pem = _peer_pem(context)
        roles = authorization.peer_roles(pem) if pem else []
        refused = authorization.refusal(method, roles)
        if refused is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
    return authorize


async def require_job(context: grpc.aio.ServicerContext, job: str) -> None:
    """Under mutual TLS, answer PERMISSION_DENIED unless the caller's certificate may act for
    ``job`` (authorization.job_refusal); without TLS there is nobody to check."""
    pem = _peer_pem(context)
    if not pem:
        return
    refused = authorization.job_refusal(job, authorization.peer_identity(pem))
    if refused is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                   streaming_reply: bool = False) -> AsyncIterator[Any]:
    async for message in requests:
        if isinstance(message, _Undecodable):
            if streaming_reply:  # the status goes out as the reply stream ends
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(_refusal(message))
                raise _RefusedStream(_refusal(message))
            await _refuse(context, message)  # raises AbortError: the status is out
        yield message


def _unary_request(fn: Callable[..., Any], check: Precheck) -> Callable[..., Any]:
    """A method taking one request: check the caller, refuse the marker, else call through (a
    coroutine, or an async generator for a response stream)."""
    if inspect.isasyncgenfunction(fn):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(context)
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async with contextlib.aclosing(fn(request, context)) as responses:
                async for response in responses:
                    yield response
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await fn(request, context)
    return call


def _stream_request(fn: Callable[..., Any], check: Precheck) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):
        async def stream(requests: AsyncIterator[Any],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(context)
            try:
                async with contextlib.aclosing(fn(_checked(requests, context, True),
                                                  context)) as responses:
                    async for response in responses:
                        yield response
            except _RefusedStream:
                return  # its status is set: it goes out now that the stream ends
        return stream

    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        return await fn(_checked(requests, context), context)
    return call


def guard(handler: grpc.RpcMethodHandler, method: str = "") -> grpc.RpcMethodHandler:
    """The same method, answering an unparsable request with INVALID_ARGUMENT and, under TLS,
    a caller without the role ``method`` needs with PERMISSION_DENIED."""
    check = _role_check(method) if tls.active() is not None and \
        method in authorization.REQUIRED_ROLE else _no_check
    if handler.request_deserializer is None and check is _no_check:
        return handler
    parse = None if handler.request_deserializer is None else \
        _safe(handler.request_deserializer)
    out = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary_request(handler.unary_unary, check), parse, out)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _unary_request(handler.unary_stream, check), parse, out)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _stream_request(handler.stream_unary, check), parse, out)
    return grpc.stream_stream_rpc_method_handler(
        _stream_request(handler.stream_stream, check), parse, out)


class ServerGuard(grpc.aio.ServerInterceptor):
    """Wraps each method once: its guarded handler is kept for the server's life."""

    def __init__(self) -> None:
        self._guarded: dict[grpc.RpcMethodHandler, grpc.RpcMethodHandler] = {}

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED
            return handler
        guarded = self._guarded.get(handler)
        if guarded is None:
            guarded = self._guarded[handler] = guard(handler, handler_call_details.method)
        return guarded
