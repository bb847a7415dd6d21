"""Randomly filled protobuf messages from a method's descriptor — huge, negative, NaN and
infinite values, long and odd strings, empty and long repeated fields — and a round of them
against every method of a running service: each answer must be a precise status (never grpc's
UNKNOWN or INTERNAL, a server bug's codes) and the service must go on serving."""

from __future__ import annotations

import math
import random

import grpc
from google.protobuf import descriptor as d
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

T = d.FieldDescriptor
_INTS = (0, 1, -1, 7, 100_000, 2**31 - 1, -2**31)
_INT64S = (*_INTS, 2**63 - 1, -2**63)
_UINTS = (0, 1, 2**32 - 1)
_UINT64S = (0, 1, 2**64 - 1)
_FLOATS = (0.0, 0.5, -1.0, 1e-30, 1e30, -1e30, math.nan, math.inf, -math.inf)
_STRINGS = ("", "x", "é" * 3, "a" * 10_000, "../../etc/passwd", "\x00")
IMPRECISE = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def _scalar(field: d.FieldDescriptor, rng: random.Random) -> object:
    kind = field.type
    if kind in (T.TYPE_INT32, T.TYPE_SINT32, T.TYPE_SFIXED32):
        return rng.choice(_INTS)
    if kind in (T.TYPE_INT64, T.TYPE_SINT64, T.TYPE_SFIXED64):
        return rng.choice(_INT64S)
    if kind in (T.TYPE_UINT32, T.TYPE_FIXED32):
        return rng.choice(_UINTS)
    if kind in (T.TYPE_UINT64, T.TYPE_FIXED64):
        return rng.choice(_UINT64S)
    if kind == T.TYPE_DOUBLE:
        return rng.choice(_FLOATS)
    if kind == T.TYPE_FLOAT:  # a float32 holds no 1e30... but does hold inf and NaN
        return rng.choice((0.0, 0.5, -1.0, math.nan, math.inf, -math.inf, 3e38))
    if kind == T.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == T.TYPE_STRING:
        return rng.choice(_STRINGS)
    if kind == T.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 3, 1000)))
    if kind == T.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    raise TypeError(f"field type {kind}")


def fill(msg: Message, rng: random.Random, depth: int = 0) -> Message:
    """Set a random subset of ``msg``'s fields to random values (sub-messages to depth 3)."""
    for field in msg.DESCRIPTOR.fields:
        if rng.random() < 0.3:
            continue
        if field.type == T.TYPE_MESSAGE:
            if depth >= 3 or field.message_type.GetOptions().map_entry:
                continue
            if field.is_repeated:
                for _ in range(rng.choice((0, 1, 2, 50))):
                    fill(getattr(msg, field.name).add(), rng, depth + 1)
            else:
                fill(getattr(msg, field.name), rng, depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).extend(
                _scalar(field, rng) for _ in range(rng.choice((0, 1, 5, 300))))
        else:
            setattr(msg, field.name, _scalar(field, rng))
    return msg


def random_message(descriptor: d.Descriptor, rng: random.Random) -> Message:
    return fill(message_factory.GetMessageClass(descriptor)(), rng)


GARBAGE = b"\xff\xff\xff"  # a truncated varint tag: no message type parses it


def method_named(path: str) -> d.MethodDescriptor:
    """The descriptor of "/pkg.Service/Method" (its proto module imported)."""
    service, _, method = path.strip("/").rpartition("/")
    return descriptor_pool.Default().FindMethodByName(f"{service}.{method}")


async def outcome(chan: grpc.aio.Channel, method: d.MethodDescriptor, request: bytes | Message,
                  timeout_s: float = 10.0) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` with one request (raw bytes or a message), read every answer; the status
    and its details."""
    kind = ("stream" if method.client_streaming else "unary") + "_" + \
        ("stream" if method.server_streaming else "unary")
    call = getattr(chan, kind)(f"/{method.containing_service.full_name}/{method.name}",
                               request_serializer=_wire)
    try:
        reply = call(iter([request]) if method.client_streaming else request, timeout=timeout_s)
        if method.server_streaming:
            async for _ in reply:
                pass
        else:
            await reply
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _wire(request: bytes | Message) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


async def garbage_status(endpoint: str, path: str) -> grpc.StatusCode:
    """What a real service answers to ``path`` ("/pkg.Service/Method") called with bytes that
    are no protobuf message (every service: INVALID_ARGUMENT)."""
    async with grpc.aio.insecure_channel(endpoint) as chan:
        return (await outcome(chan, method_named(path), GARBAGE))[0]


async def fuzz_service(endpoint: str, service: d.ServiceDescriptor, rounds: int, seed: int = 0,
                       timeout_s: float = 1.0) -> None:
    """``rounds`` random requests to every method of ``service`` at ``endpoint``; fails unless
    every method answered and none with an imprecise status. A stream still open at
    ``timeout_s`` (a worker session) ends with DEADLINE_EXCEEDED, the client's own doing."""
    rng = random.Random(seed)
    codes: dict[str, set[grpc.StatusCode]] = {}
    async with grpc.aio.insecure_channel(endpoint) as chan:
        for _ in range(rounds):
            for method in service.methods:
                request = random_message(method.input_type, rng)
                code, _ = await outcome(chan, method, request, timeout_s)
                codes.setdefault(method.name, set()).add(code)
    assert set(codes) == {m.name for m in service.methods}, codes
    assert not {c for answered in codes.values() for c in answered} & IMPRECISE, codes
