"""The trainer's gRPC shell: status only. The trainer is a client of the manager and the agent;
nothing calls into its training loop."""

from __future__ import annotations

import grpc

from rlharvest.common import errors
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.services.trainer.status import RunStatus


class TrainerService(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, status: RunStatus, *, trainer_id: str, job: str, target_steps: int) -> None:
        self._status = status
        self._trainer_id = trainer_id
        self._job = job
        self._target_steps = target_steps

    async def GetStatus(self, request: tpb.TrainerStatusRequest,
                        context: grpc.aio.ServicerContext) -> tpb.TrainerStatus:
        if request.last_steps < 0:
            await errors.abort(context, errors.InvalidArgument(
                f"last_steps {request.last_steps} is negative; ask for 0 (all kept) or a "
                "positive count"))
        st = self._status
        steps = st.summaries[-request.last_steps:] if request.last_steps else st.summaries
        cur = st.current
        return tpb.TrainerStatus(
            trainer_id=self._trainer_id, job=self._job, state=st.state, steps_done=st.steps_done,
            target_steps=self._target_steps, weight_version=st.weight_version,
            resumed_from_step=st.resumed_from_step, steps=steps, error=st.error,
            current=tpb.StepProgress(step=cur.step, weight_version=cur.weight_version,
                                     samples=cur.samples, completions=cur.completions,
                                     groups_trained=cur.groups_trained,
                                     tokens_generated=cur.tokens_generated, phase=cur.phase))

    def health(self) -> dict:
        st = self._status
        return {"status": "ok" if st.state != "failed" else "failed", "state": st.state,
                "steps_done": st.steps_done, "weight_version": st.weight_version,
                "error": st.error}
