"""The weight data path over HTTP: the agent serves byte ranges of a planned pull's buckets and a
puller fetches them over several connections at once, straight into preallocated buffers.

Why HTTP and not the gRPC stream: measured on loopback (bench/transfer_data_path.py) aiohttp
moves bytes at raw-socket speed while a grpc.aio stream of 16 MB messages reaches ~0.75x of it —
every message is copied into a bytes object on both sides. Control stays on gRPC: PlanPull answers
the manifest (and, in its trailing metadata, this server's address), refusals there are gRPC
statuses. Here a refusal is the HTTP status below with the same message and the gRPC code name
in ``X-RLH-Code``.

    GET /v1/buckets/{index}
    X-RLH-Pull:  urlsafe base64 of the PullRequest that PlanPull answered (version pinned)
    X-RLH-Plan:  PullPlan.plan_id (409 if the plan changed since, e.g. its base was evicted)
    Range:       bytes=START-END (inclusive, one range; absent: the whole bucket)
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import aiohttp
import grpc
from aiohttp import web

from rlharvest.common import errors, rpc, tls
from rlharvest.common.authorization import role_name
from rlharvest.common.observability import serve_app
from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent import metrics
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.data_path import Part, parse_range, split_parts
from rlharvest.services.transfer_agent.protocol import AGENT_ROLE
from rlharvest.services.transfer_agent.throttle import TokenBucket

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.OUT_OF_RANGE: 416, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
_MAX_PULL_HEADER = 64 << 10  # a PullRequest with every tensor name of a large model fits
DEFAULT_READ_TIMEOUT_S = 30.0


class DataPathError(RuntimeError):
    """A bucket range that could not be fetched: the agent refused it (``code`` is the gRPC code
    name it gave) or the connection broke (``code`` "UNAVAILABLE")."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


# ---- agent side ------------------------------------------------------------------------------


class _Buckets(Protocol):
    """What a planned pull serves here: its buckets."""

    buckets: list[bytes]


class BucketServer(Protocol):
    """The agent's side of the data path, as this module calls it (the servicer is one); a
    protocol, so the data path never imports the servicer."""

    async def planned_buckets(self, pull: pb.PullRequest, plan_id: int,
                              indices: Sequence[int]) -> _Buckets: ...

    def send_path(self, pull: pb.PullRequest) -> tuple[list[TokenBucket], str]: ...

    def damage(self) -> bool: ...

    def note_refusal(self, rpc_name: str, refused: errors.ServiceError) -> None: ...

    @property
    def cfg(self) -> AgentConfig: ...


def data_app(service: BucketServer) -> web.Application:
    async def get_bucket(request: web.Request) -> web.StreamResponse:
        try:
            index, pull, plan_id = _parse(request)
            packed = await service.planned_buckets(pull, plan_id, [index])
            bucket = packed.buckets[index]
            start, stop = parse_range(request.headers.get("Range"), len(bucket))
        except errors.ServiceError as exc:  # RangeError included: OUT_OF_RANGE
            return _refusal(service, exc)
        throttles, link = service.send_path(pull)
        ranged = "Range" in request.headers
        response = web.StreamResponse(status=206 if ranged else 200)
        response.content_length = stop - start
        response.content_type = "application/octet-stream"
        if ranged:
            response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(bucket)}"
        await response.prepare(request)
        view = memoryview(bucket)
        chunk_bytes = service.cfg.chunk_bytes
        started = time.perf_counter()
        for offset in range(start, stop, chunk_bytes):
            # a view: no copy until the kernel (bytes only when damage() corrupts a chunk)
            data: memoryview | bytes = view[offset:min(offset + chunk_bytes, stop)]
            for throttle in throttles:
                wait = throttle.reserve(len(data), time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
            if service.damage():
                data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
            await response.write(data)
            metrics.BYTES_OUT.labels(link).inc(len(data))
        metrics.BUCKET_SECONDS.observe(time.perf_counter() - started)
        await response.write_eof()
        return response

    app = web.Application(client_max_size=1 << 20)
    app.router.add_get("/v1/buckets/{index}", get_bucket)
    return app


async def start_data_server(service: BucketServer, host: str,
                            port: int) -> tuple[web.AppRunner, int]:
    return await serve_app(data_app(service), host, port)


def _parse(request: web.Request) -> tuple[int, pb.PullRequest, int]:
    try:
        index = int(request.match_info["index"])
    except ValueError:
        raise errors.InvalidArgument(f"bucket index {request.match_info['index']!r} is not an "
                                     "integer") from None
    encoded = request.headers.get("X-RLH-Pull", "")
    if not encoded or len(encoded) > _MAX_PULL_HEADER:
        raise errors.InvalidArgument("X-RLH-Pull must carry the PullRequest PlanPull answered "
                                     "(urlsafe base64, at most 64 KiB)")
    try:
        pull = pb.PullRequest.FromString(base64.urlsafe_b64decode(encoded))
        plan_id = int(request.headers.get("X-RLH-Plan", "0"))
    except Exception as exc:  # binascii, protobuf DecodeError, int(): all mean a malformed header
        raise errors.InvalidArgument(f"X-RLH-Pull or X-RLH-Plan is malformed "
                                     f"({type(exc).__name__}); send the PullRequest PlanPull "
                                     "answered and its plan_id") from None
    if not 0 <= plan_id < 1 << 32:
        raise errors.InvalidArgument(f"X-RLH-Plan {plan_id} is not a CRC-32")
    return index, pull, plan_id


def _refusal(service: BucketServer, refused: errors.ServiceError) -> web.Response:
    """A refusal over HTTP: the status matching its gRPC code, the code's name in X-RLH-Code."""
    service.note_refusal("HttpBucket", refused)
    return web.Response(status=_HTTP_STATUS.get(refused.code, 400), text=str(refused),
                        headers={"X-RLH-Code": refused.code.name})


# ---- puller side -----------------------------------------------------------------------------


class RangeFetcher:
    """Fetches buckets of one planned pull from an agent's data endpoint over ``streams``
    parallel connections, each bucket cut into byte ranges written straight into ``buffers``.
    A connection that brings no byte for ``read_timeout_s`` fails its range with DataPathError
    (UNAVAILABLE), so a stalled sender is treated like a dead one. Under TLS the server's
    certificate must name an agent's role (``agent.role.rlharvest``, checked in the handshake
    instead of the host, as ``rpc.channel(peer_role=)`` does): a data endpoint of another
    role's certificate fails its ranges with DataPathError (UNAVAILABLE) saying so."""

    def __init__(self, data_endpoint: str, request: pb.PullRequest, plan_id: int,
                 buffers: Mapping[int, bytearray], streams: int,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self._url = f"{tls.http_scheme()}://{data_endpoint}/v1/buckets/"
        self._headers = {"X-RLH-Pull": base64.urlsafe_b64encode(request.SerializeToString())
                         .decode(), "X-RLH-Plan": str(plan_id)}
        self._buffers = buffers
        self._streams = streams
        self._read_timeout_s = read_timeout_s
        self._server_hostname = role_name(AGENT_ROLE) if tls.active() is not None else None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RangeFetcher:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._streams,
                                           ssl=tls.client_ssl_context() or True),
            read_bufsize=4 << 20, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                          sock_read=self._read_timeout_s))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._open_session().close()

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("RangeFetcher has no HTTP session: use it as `async with "
                               "RangeFetcher(...) as fetcher:`")
        return self._session

    async def fetch(self, indices: Sequence[int], on_bucket: Callable[[int], None]) -> None:
        """Fetch every bucket in ``indices``; ``on_bucket(i)`` runs as soon as bucket i's last
        range landed (the caller checksums it off the event loop while the rest stream)."""
        sizes = {i: len(self._buffers[i]) for i in indices}
        parts = split_parts(sizes, self._streams)
        left = {i: sum(1 for b, _, _ in parts if b == i) for i in indices}

        def landed(part: Part) -> None:
            left[part[0]] -= 1
            if not left[part[0]]:
                on_bucket(part[0])

        for index in [i for i, n in left.items() if not n]:  # empty: nothing to fetch
            on_bucket(index)
        await self.fetch_parts(parts, landed)

    async def fetch_parts(self, parts: Sequence[Part], on_part: Callable[[Part], None]) -> None:
        """Fetch the given ranges over the fetcher's connections, in order; ``on_part(part)``
        runs as each one lands. On a DataPathError the parts not reported are not (all) in."""
        queue = list(reversed(parts))

        async def stream() -> None:
            while queue:
                part = queue.pop()
                await self._get(*part)
                on_part(part)

        tasks = [asyncio.create_task(stream()) for _ in range(min(self._streams, len(parts)))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _get(self, index: int, start: int, stop: int) -> None:
        view = memoryview(self._buffers[index])
        headers = {**self._headers, "Range": f"bytes={start}-{stop - 1}"}
        try:
            async with self._open_session().get(f"{self._url}{index}", headers=headers,
                                                server_hostname=self._server_hostname) as response:
                if response.status not in (200, 206):
                    message = await response.text()
                    raise DataPathError(f"bucket {index} [{start}, {stop}): {message}",
                                        response.headers.get("X-RLH-Code", str(response.status)))
                at = start
                async for data in response.content.iter_any():
                    if at + len(data) > stop:
                        raise DataPathError(f"bucket {index}: the agent sent more than the "
                                            f"{stop - start} bytes asked for", "DATA_LOSS")
                    view[at:at + len(data)] = data
                    at += len(data)
        except aiohttp.ClientConnectorCertificateError as exc:
            raise DataPathError(
                f"bucket {index} [{start}, {stop}): the data endpoint's TLS certificate was "
                f"refused ({exc.certificate_error}): {rpc.role_refusal(AGENT_ROLE)}",
                "UNAVAILABLE") from None
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            raise DataPathError(f"bucket {index} [{start}, {stop}): connection to the agent "
                                f"broke ({type(exc).__name__}: {exc})", "UNAVAILABLE") from None
        if at != stop:
            raise DataPathError(f"bucket {index}: got {at - start} of {stop - start} bytes; the "
                                "agent closed the range early", "UNAVAILABLE")
