"""Long-tail migration trigger (WEAVE §4.3 "Long-Tail Migration", §5.1 runtime hook).

Admission plans for every response reaching the token limit (§4.2); at run time most responses
finish early and a few stragglers hold the whole rollout node set. Once a rollout phase is
*tail-bound* (a threshold, e.g. 80%, of its responses are done) the scheduler consolidates the
remaining requests onto a few nodes and starts the next queued rollout on the freed ones
(``PhaseQueues.shrink`` + ``acquire``). Only the remaining *requests* move (footnote 4), so what
the rollout produces does not change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rlharvest.services.placement_scheduler.model import PlacementError


@dataclass(frozen=True)
class RolloutProgress:
    """What the runtime hook reports for one running rollout phase."""

    job_id: str
    total_responses: int
    finished_responses: int
    unfinished_by_node: Mapping[str, int]  # every node the phase holds, with its open requests

    def __post_init__(self) -> None:
        open_requests = sum(self.unfinished_by_node.values())
        if not 0 <= self.finished_responses <= self.total_responses or min(
                self.unfinished_by_node.values(), default=0) < 0:
            raise PlacementError(f"rollout progress of job {self.job_id!r} is inconsistent: "
                                 f"{self.finished_responses}/{self.total_responses} finished, "
                                 f"open per node {dict(self.unfinished_by_node)}")
        if open_requests != self.total_responses - self.finished_responses:
            raise PlacementError(f"rollout progress of job {self.job_id!r}: {open_requests} open "
                                 f"requests on nodes but {self.total_responses} - "
                                 f"{self.finished_responses} unfinished; report every node")


@dataclass(frozen=True)
class TailMigration:
    """Consolidate ``job_id``'s open requests onto ``keep_node_ids``; ``moves`` lists
    (from node, to node, request count); ``freed_node_ids`` go to the next queued rollout."""

    job_id: str
    keep_node_ids: tuple[str, ...]
    freed_node_ids: tuple[str, ...]
    moves: tuple[tuple[str, str, int], ...]


def plan_tail_migration(progress: RolloutProgress, requests_per_node: int,
                        threshold: float = 0.8, min_keep_nodes: int = 1) -> TailMigration | None:
    """The migration to run now, or None while the phase is not tail-bound or nothing would be
    freed. Keeps the fewest nodes that can hold the open requests (``requests_per_node`` each,
    at least ``min_keep_nodes``), choosing the nodes with most open requests so fewest move."""
    if not 0 < threshold <= 1 or requests_per_node < 1 or min_keep_nodes < 1:
        raise PlacementError(f"need 0 < threshold <= 1, requests_per_node >= 1 and "
                             f"min_keep_nodes >= 1; got {threshold}, {requests_per_node}, "
                             f"{min_keep_nodes}")
    if progress.total_responses == 0 or \
            progress.finished_responses < threshold * progress.total_responses:
        return None
    open_requests = progress.total_responses - progress.finished_responses
    keep_count = max(min_keep_nodes, math.ceil(open_requests / requests_per_node))
    if keep_count >= len(progress.unfinished_by_node):
        return None
    ranked = sorted(progress.unfinished_by_node.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = [node for node, _ in ranked[:keep_count]]
    freed = [node for node, _ in ranked[keep_count:]]
    return TailMigration(progress.job_id, tuple(keep), tuple(freed),
                         _moves(progress.unfinished_by_node, keep, freed, requests_per_node))


def _moves(open_by_node: Mapping[str, int], keep: list[str], freed: list[str],
           requests_per_node: int) -> tuple[tuple[str, str, int], ...]:
    """Fill kept nodes up to capacity, least-loaded first, from the freed nodes."""
    room = {node: requests_per_node - open_by_node[node] for node in keep}
    moves = []
    for source in freed:
        left = open_by_node[source]
        for target in sorted(keep, key=lambda n: -room[n]):
            if left == 0:
                break
            take = min(left, max(room[target], 0))
            if take:
                moves.append((source, target, take))
                room[target] -= take
                left -= take
        if left:  # more open requests than the kept nodes' nominal capacity: overfill evenly
            target = max(keep, key=lambda n: room[n])
            moves.append((source, target, left))
            room[target] -= left
    return tuple(moves)
