"""gRPC bootstrap shared by every service: server with health + reflection + size limits +
keepalive, graceful stop within a bound, and client channels with transparent retries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlharvest.common import tls
from rlharvest.common.authorization import role_name
from rlharvest.common.server_guard import ServerGuard

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # weight chunks are tens of MB; bigger is refused

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Peers restart (a standby manager takes over, a worker or trainer comes back): a channel tries
# again within a second, not after gRPC's default backoff, which grows to two minutes and made
# a poller see a restarted peer only long after it was up.
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
# The server side must accept the clients' keepalive pings, or it answers GOAWAY too_many_pings.
_SERVER_PING_POLICY = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def _size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


class Server:
    """A started grpc.aio server plus its health service; ``stop`` drains within ``grace``."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.HealthServicer,
                 port: int, service_names: list[str]):
        self.grpc = server
        self.health = health_servicer
        self.port = port
        self.service_names = service_names
        self.serving = False  # what the health service says (also /readyz over HTTP)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.grpc.stop(grace)


def bind_server(host: str = "127.0.0.1", port: int = 0,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, int]:
    """A server bound to host:port (0 picks a free port), not started yet: its port is known
    before its servicers are built. Returns it and the bound port."""
    server = grpc.aio.server(
        # An unparsable request: INVALID_ARGUMENT, not UNKNOWN; under TLS, roles per method.
        interceptors=[ServerGuard()],
        options=_size_options(max_message_bytes) + _KEEPALIVE + _SERVER_PING_POLICY)
    credentials = tls.server_credentials()  # mutual TLS when the process configured it
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else \
        server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return server, bound


async def serve(server: grpc.aio.Server, port: int,
                register: Iterable[Callable[[grpc.aio.Server], None]], service_names: list[str],
                serving: bool = True) -> Server:
    """Add the servicers (``register``), health and reflection to a bound server and start it.
    ``service_names`` are the servicers' full names for health and reflection; ``serving``
    False starts it NOT_SERVING (a standby)."""
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    await server.start()
    started = Server(server, health_servicer, port, service_names)
    await started.set_serving(serving)
    return started


async def start_server(register: Iterable[Callable[[grpc.aio.Server], None]],
                       service_names: list[str], host: str = "127.0.0.1", port: int = 0,
                       max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Server:
    """Bind and serve in one step, SERVING at once (tests and benchmarks; services are hosted
    by ``service_host``)."""
    server, bound = bind_server(host, port, max_message_bytes)
    return await serve(server, bound, register, service_names)


def _retry_service_config(service_names: list[str]) -> str:
    # Retries of every method of these services when a peer restarts (UNAVAILABLE). gRPC retries
    # a call only while nothing of its response came back (a stream: before its first message,
    # and within the client's retry buffer), so a call that began is never replayed: a stream
    # that broke after it started is resumed by its owner with its own state (a manager
    # re-dispatches, a trainer re-attaches, etc.).
    return json.dumps({"methodConfig": [{
        "name": [{"service": name} for name in service_names],
        "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "2s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]})


def channel(target: str, service_names: list[str] | None = None,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
            peer_role: str | None = None) -> grpc.aio.Channel:
    """A channel to ``target``: under TLS with this process's certificate, trusting only the CA.

    ``peer_role``: the role the server must hold (``agent``, ``worker``, ...), for a target read
    from etcd where a peer of another role could do harm (one posing as a weight holder serves
    its own weights, which its own manifest's checksums vouch for). Under TLS the handshake then
    checks that the server's certificate names ``<role>.role.rlharvest`` (``role_name``; grpc
    gives a client no access to the server's certificate, so it cannot look at the role URI
    after the handshake). This replaces the check that the certificate names the host dialed:
    for an endpoint anyone who may write etcd can name, the role is what matters, and a
    certificate of the CA for that role is trusted wherever it is. A server whose certificate
    lacks the name fails the handshake (UNAVAILABLE, "Hostname Verification Check failed";
    ``error_text`` says what it means). Without TLS there are no identities to check."""
    options: list[tuple[str, int | str]] = [*_size_options(max_message_bytes), *_KEEPALIVE,
                                            *_RECONNECT]
    if service_names:
        options.append(("grpc.service_config", _retry_service_config(service_names)))
    credentials = tls.channel_credentials()
    if credentials is not None:
        if peer_role is not None:
            options.append(("grpc.ssl_target_name_override", role_name(peer_role)))
        return grpc.aio.secure_channel(target, credentials, options=options)
    return grpc.aio.insecure_channel(target, options=options)


_NAME_CHECK_FAILED = "Hostname Verification Check failed"


def error_text(exc: BaseException, peer_role: str | None = None) -> str:
    """A failed call's message for a log: the status details of a gRPC error (else ``str``),
    and, when the handshake refused a server of ``peer_role`` because its certificate lacks
    the role's name, what that means."""
    text = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) \
        else str(exc)
    if peer_role is not None and _NAME_CHECK_FAILED in text:
        text += f" ({role_refusal(peer_role)})"
    return text


def role_refusal(peer_role: str) -> str:
    """What a handshake refusing a server dialed as ``peer_role`` means (gRPC's and the
    data path's)."""
    return (f"its TLS certificate does not name the role {peer_role!r} as the DNS name "
            f"{role_name(peer_role)}: a peer of another role, or a certificate issued before "
            "clients checked roles; reissue it with that name")


def status_in(*codes: grpc.StatusCode) -> Callable[[Exception], bool]:
    """A ``retry.retry`` predicate: the call failed with one of these gRPC status codes."""
    return lambda exc: isinstance(exc, grpc.aio.AioRpcError) and exc.code() in codes


async def wait_healthy(target: str, timeout: float = 30.0, service: str = "") -> None:
    """Block until the server at ``target`` reports SERVING (used by launchers and tests)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with channel(target) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() >= deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout}s")
            await asyncio.sleep(0.1)
