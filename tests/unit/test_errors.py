"""The one mapping from domain errors to gRPC status codes, and what a client sees of it over a
real gRPC server on loopback."""

from __future__ import annotations

import grpc
import pytest

from rlharvest.common import errors, rpc
from rlharvest.common.pb import trainer_pb2, trainer_pb2_grpc
from rlharvest.services.placement_scheduler.control import Refusal
from rlharvest.services.transfer_agent.data_path import RangeError
from rlharvest.services.transfer_agent.shard_staging import ShardStagingError
from rlharvest.services.transfer_agent.sharding import ShardingError
from rlharvest.services.transfer_agent.version_store import (
    OverBudgetError,
    UnknownTensorsError,
    VersionOrderError,
    VersionStoreError,
    VersionUnavailableError,
)

S = grpc.StatusCode


@pytest.mark.parametrize("error, code", [
    (errors.InvalidArgument("x"), S.INVALID_ARGUMENT),
    (errors.FailedPrecondition("x"), S.FAILED_PRECONDITION),
    (errors.NotFound("x"), S.NOT_FOUND),
    (errors.AlreadyExists("x"), S.ALREADY_EXISTS),
    (errors.ResourceExhausted("x"), S.RESOURCE_EXHAUSTED),
    (errors.Unavailable("x"), S.UNAVAILABLE),
    (errors.Aborted("x"), S.ABORTED),
    (errors.OutOfRange("x"), S.OUT_OF_RANGE),
    (errors.DataLoss("x"), S.DATA_LOSS),
])
def test_each_kind_of_refusal_has_its_status(error: errors.ServiceError, code: S) -> None:
    assert error.code is code


@pytest.mark.parametrize("error, code", [
    (VersionStoreError("x"), S.INVALID_ARGUMENT),
    (VersionOrderError("x"), S.FAILED_PRECONDITION),
    (OverBudgetError("x"), S.RESOURCE_EXHAUSTED),
    (UnknownTensorsError("x"), S.NOT_FOUND),
    (VersionUnavailableError("x", None), S.NOT_FOUND),
    (ShardingError("x"), S.INVALID_ARGUMENT),
    (ShardStagingError("x"), S.INVALID_ARGUMENT),
    (ShardStagingError("x", code=S.ALREADY_EXISTS), S.ALREADY_EXISTS),
    (RangeError("x"), S.OUT_OF_RANGE),
    (Refusal("invalid", "x"), S.INVALID_ARGUMENT),
    (Refusal("precondition", "x"), S.FAILED_PRECONDITION),
    (Refusal("exists", "x"), S.ALREADY_EXISTS),
    (Refusal("not_found", "x"), S.NOT_FOUND),
    (Refusal("exhausted", "x"), S.RESOURCE_EXHAUSTED),
])
def test_domain_errors_carry_their_status_by_type_never_by_message(error: errors.ServiceError,
                                                                    code: S) -> None:
    assert isinstance(error, errors.ServiceError) and error.code is code


def test_a_case_specific_code_does_not_change_its_class() -> None:
    ShardStagingError("x", code=S.ALREADY_EXISTS)
    assert ShardStagingError("y").code is S.INVALID_ARGUMENT


def test_domain_errors_stay_value_errors_for_callers_that_catch_those() -> None:
    for error in (VersionStoreError("x"), ShardingError("x"), ShardStagingError("x"),
                  RangeError("x")):
        assert isinstance(error, ValueError)


class _Refusing(trainer_pb2_grpc.TrainerServicer):
    async def GetStatus(self, request, context) -> trainer_pb2.TrainerStatus:
        await errors.abort(context, UnknownTensorsError("version 3 has no tensors named ['w']; "
                                                        "ask for names from its manifest"))


async def test_abort_answers_the_status_and_the_message_the_error_carries() -> None:
    name = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
    server = await rpc.start_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(_Refusing(), s)], [name])
    try:
        async with rpc.channel(f"127.0.0.1:{server.port}") as chan:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await trainer_pb2_grpc.TrainerStub(chan).GetStatus(
                    trainer_pb2.TrainerStatusRequest(), timeout=5)
    finally:
        await server.stop(0)
    assert refused.value.code() is S.NOT_FOUND
    assert refused.value.details() == ("version 3 has no tensors named ['w']; ask for names "
                                       "from its manifest")
