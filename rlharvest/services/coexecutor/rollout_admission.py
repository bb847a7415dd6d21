"""Which rollout requests a co-executor takes (ROSE §4.1: "no slack or budget" -> elsewhere).

The rollout worker's checks first (draining, version, duplicates, running + pending limit),
then lending and memory: a co-executor lent to no job refuses with UNAVAILABLE (the manager
places the request elsewhere), and a request whose KV (prompt + resumed tokens + the next one) does not fit in what
B_roll leaves is refused with RESOURCE_EXHAUSTED, which the manager answers by placing it
elsewhere. Under PRESSURE rollout goes on within the halved budget, as the paper has it (the
freeze only stops B_roll from growing back).
Requests taken but not yet started hold no pages, so a burst of adds can still overshoot the
budget; the dual engine then aborts the growth that does not fit (back to the manager). Pure:
reads two numbers through the callables it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from rlharvest.common.engine_types import EngineRequest
from rlharvest.common.errors import ResourceExhausted, ServiceError, Unavailable
from rlharvest.common.worker_core.admission import Admission, Wanted, WorkerView
from rlharvest.services.coexecutor.page_pool import pages_for


class CoexecRolloutAdmission:
    def __init__(self, base: Admission, room_pages: Callable[[], int],
                 tokens_per_page: int, lent: Callable[[], bool] = lambda: True) -> None:
        self._base = base
        self._lent = lent
        self._room = room_pages
        self._tpp = tokens_per_page

    def admit(self, request: EngineRequest, wanted: Wanted,
              view: WorkerView) -> ServiceError | None:
        if not self._lent():
            return Unavailable(f"request {request.request_id}: this co-executor is lent to no "
                               "job now (its lending ended or lapsed); dispatch elsewhere")
        refused = self._base.admit(request, wanted, view)
        if refused is not None:
            return refused
        need = pages_for(len(request.prompt_token_ids) + len(request.generated_token_ids) + 1,
                         self._tpp)
        room = self._room()
        if need > room:
            return ResourceExhausted(f"request {request.request_id} needs {need} KV pages, the "
                                     f"rollout budget leaves {room}; dispatch elsewhere")
        return None

    def on_weight_swap(self, version: int, held: Mapping[str, int]) -> Collection[str]:
        return self._base.on_weight_swap(version, held)
