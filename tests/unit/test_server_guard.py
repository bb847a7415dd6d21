"""Every RPC of every rlharvest service answers a request that is not a valid protobuf with
INVALID_ARGUMENT (``rlharvest/common/server_guard.py``, installed by ``rpc.bind_server``), not grpcio's
UNKNOWN, and lets valid requests through; the server keeps serving. Real gRPC over loopback,
each method's real message types; behind the guard stands a servicer that reads every request
and answers UNIMPLEMENTED (the real servicers, on real processes: the integration tests)."""

from __future__ import annotations

import importlib

import grpc
import pytest
from google.protobuf import message_factory

from rlharvest.common import rpc
from tests.fuzz_messages import GARBAGE, outcome

PROTOS = ["common", "rollout_worker", "rollout_manager", "transfer_agent", "trainer",
          "placement_scheduler"]


def services():
    """The descriptor of every service of every rlharvest proto."""
    for name in PROTOS:
        pb2 = importlib.import_module(f"rlharvest.common.pb.{name}_pb2")
        yield from pb2.DESCRIPTOR.services_by_name.values()


SERVICES = list(services())
METHODS = [(s.full_name, m) for s in SERVICES for m in s.methods]


def reading_handler(method) -> grpc.RpcMethodHandler:
    """Reads the whole request, then UNIMPLEMENTED: where a real servicer would act."""
    parse = message_factory.GetMessageClass(method.input_type).FromString
    write = message_factory.GetMessageClass(method.output_type).SerializeToString

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "read")

    async def streamed(requests, context):
        async for _ in requests:
            pass
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "read")

    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(streamed, parse, write)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(streamed, parse, write)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(unary, parse, write)
    return grpc.unary_unary_rpc_method_handler(unary, parse, write)


@pytest.fixture
async def server():
    register = [lambda srv, s=s: srv.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(
            s.full_name, {m.name: reading_handler(m) for m in s.methods}),)) for s in SERVICES]
    started = await rpc.start_server(register, [s.full_name for s in SERVICES])
    yield started.port
    await started.stop(0)


def test_every_service_of_every_proto_is_covered():
    names = {s.full_name for s in SERVICES}
    assert {"rlharvest.v1.RolloutWorker", "rlharvest.v1.RolloutManager",
            "rlharvest.v1.TransferAgent", "rlharvest.v1.Trainer"} <= names
    assert len(METHODS) >= 15


async def test_an_unparsable_request_gets_invalid_argument_on_every_rpc(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server}") as chan:
        for service, method in METHODS:
            code, details = await outcome(chan, method, GARBAGE)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (service, method.name, code)
            assert method.input_type.full_name in details, details
        # ...and the server still serves: a valid request reaches the (unimplemented) servicer.
        for service, method in METHODS:
            code, _ = await outcome(chan, method, b"")
            assert code == grpc.StatusCode.UNIMPLEMENTED, (service, method.name, code)


async def test_a_bidi_servicer_reading_in_another_task_ends_with_invalid_argument():
    """The worker's Session shape: a reader task consumes the commands while the handler
    streams events. The undecodable command's status is set, the reader sees AbortError, and
    the status goes out when the handler's stream ends, from the RPC's own task."""
    import asyncio

    from rlharvest.common.pb import rollout_worker_pb2 as wpb

    method = wpb.DESCRIPTOR.services_by_name["RolloutWorker"].methods_by_name["Session"]
    seen: list[str] = []

    async def session(requests, context):
        done = asyncio.Event()

        async def read() -> None:
            try:
                async for _ in requests:
                    pass
            except grpc.aio.AbortError as exc:
                seen.append(type(exc).__name__)
            done.set()

        reader = asyncio.ensure_future(read())
        yield wpb.WorkerEvent()  # the hello, as the worker sends one first
        await done.wait()
        await reader

    handler = grpc.stream_stream_rpc_method_handler(
        session, wpb.WorkerCommand.FromString, wpb.WorkerEvent.SerializeToString)
    started = await rpc.start_server([lambda srv: srv.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("rlharvest.v1.RolloutWorker",
                                             {"Session": handler}),))],
        ["rlharvest.v1.RolloutWorker"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as chan:
            for _ in range(20):
                code, details = await outcome(chan, method, GARBAGE, timeout_s=5)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
                assert "WorkerCommand" in details
    finally:
        await started.stop(0)
    assert seen == ["_RefusedStream"] * 20
