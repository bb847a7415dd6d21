"""The etcd key layout, in one place. Every key rlharvest writes lives under ROOT.

/rlharvest/v1/members/<service>/<member_id>      JSON member info, attached to the member's lease
/rlharvest/v1/election/<name>/<lease_id_hex>     election candidates; lowest create revision leads
/rlharvest/v1/versions/<name>                    versioned record: JSON {"version": int, ...}
/rlharvest/v1/weights/<job>/announced            latest weight version announced for a job
/rlharvest/v1/weights/<job>/holders/<agent_id>   which agents hold which versions (transfer agents)
/rlharvest/v1/pairing/<worker_id>                the transfer agent a rollout worker pulls from
/rlharvest/v1/jobs/<job>/instance_cap            the job's remote-instance cap N_prem {"n_prem"}
/rlharvest/v1/jobs/<job>/tp_plan                 the job's advisory TP plan (RollPacker §4.2),
                                                 written by its manager with --tp-planner
/rlharvest/v1/jobs/<job>/start_weights           the fingerprint of the job's version 0, written by
                                                 its trainer {"fingerprint","source"}
/rlharvest/v1/jobs/<job>/stream_scale            the job's last stream-trainer scale-down
                                                 (RollPacker §4.4): workers lent to training
                                                 and when they are back (--stream-scaling)
/rlharvest/v1/lending/<coexec_id>                the job a serving co-executor is lent to (ROSE
                                                 §5): {"job", "manager"}, on the manager's lease
/rlharvest/v1/placement/...                      placement scheduler state (nodes, groups, permits)
/rlharvest/v1/placement/state/meta               scheduler counters and statistics
/rlharvest/v1/placement/state/groups/<group_id>  a co-execution group: members, nodes, permit queues
/rlharvest/v1/placement/state/jobs/<job_id>      a placed job's record (lease, SLO bookkeeping)
/rlharvest/v1/placement/alive/<job_id>           attached to the job client's lease: gone = failed
"""

from __future__ import annotations

ROOT = "/rlharvest/v1"

SERVICES = (
    "rollout_worker",
    "rollout_manager",
    "transfer_agent",
    "trainer",
    "coexecutor",
    "placement_scheduler",
)


def _segment(value: str, what: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{what} {value!r} must be non-empty and contain no '/'")
    return value


def members_prefix(service: str | None = None) -> str:
    if service is None:
        return f"{ROOT}/members/"
    return f"{ROOT}/members/{_segment(service, 'service')}/"


def member_key(service: str, member_id: str) -> str:
    return members_prefix(service) + _segment(member_id, "member id")


def parse_member_key(key: str) -> tuple[str, str]:
    """(service, member_id) of a key under members_prefix()."""
    rest = key.removeprefix(members_prefix())
    service, _, member_id = rest.partition("/")
    if not service or not member_id:
        raise ValueError(f"{key!r} is not a member key")
    return service, member_id


def election_prefix(name: str) -> str:
    return f"{ROOT}/election/{_segment(name, 'election name')}/"


def versioned_key(name: str) -> str:
    return f"{ROOT}/versions/{_segment(name, 'record name')}"


def weights_prefix() -> str:
    return f"{ROOT}/weights/"


def weights_announced_key(job: str) -> str:
    return f"{ROOT}/weights/{_segment(job, 'job')}/announced"


def weights_holder_key(job: str, agent_id: str) -> str:
    return f"{ROOT}/weights/{_segment(job, 'job')}/holders/{_segment(agent_id, 'agent id')}"


def instance_cap_key(job: str) -> str:
    """The job's remote-instance cap N_prem (RLBoost Algorithm 1): {"n_prem": int}; absent, no
    cap. Its controller writes it; the job's manager holds workers beyond it as standby, and an
    autoscaler reads it to start no more spot instances than will be used."""
    return f"{ROOT}/jobs/{_segment(job, 'job')}/instance_cap"


def tp_plan_key(job: str) -> str:
    """The job's TP plan (RollPacker §4.2 "Adaptive TP Selection"): the TP size of the next short
    and long round and the planner state behind it (``rollout_manager/tp_accounting.py``,
    ``plan_record``). Its manager writes it after each step when run with ``--tp-planner`` and
    reads it back at start; advisory: an operator, an autoscaler or a vLLM deployment applies it."""
    return f"{ROOT}/jobs/{_segment(job, 'job')}/tp_plan"


def start_weights_key(job: str) -> str:
    """The job's start weights (version 0) by fingerprint (rlharvest/common/start_weights.py): a manager
    sends a version-0 request only to a worker whose start weights are these."""
    return f"{ROOT}/jobs/{_segment(job, 'job')}/start_weights"


def stream_scale_key(job: str) -> str:
    """The job's last stream-trainer scale-down (RollPacker §4.4, Algorithm 1 lines 13-21): which
    rollout workers its manager lent to training for the rest of which step, the projection
    behind it, and "returned" once the step ended (``rollout_manager/stream_accounting.py``,
    ``scale_record``). Its manager writes it when run with ``--stream-scaling``; advisory: a
    trainer or an autoscaler may run training on the lent workers' GPUs until then."""
    return f"{ROOT}/jobs/{_segment(job, 'job')}/stream_scale"


def pairing_key(worker_id: str) -> str:
    return f"{ROOT}/pairing/{_segment(worker_id, 'worker id')}"


def placement_prefix() -> str:
    return f"{ROOT}/placement/"


# The placement scheduler's leader election (registry.Election); a candidate's value is the
# endpoint it serves on, so clients find the leader here.
PLACEMENT_ELECTION = "placement_scheduler"


def manager_election(job: str, shard: int = 0, shards: int = 1) -> str:
    """The election of ``job``'s rollout managers (of one ``shard`` of ``shards`` when the job's
    manager is split, rollout_manager/sharding.py): the oldest candidate leads, the rest stand
    by. One shard keeps the job's name, so a single manager's key is unchanged; ':' is no
    job-name character, so no job's name collides with another job's shard."""
    name = f"rollout_manager.{_segment(job, 'job')}"
    return name if shards == 1 else f"{name}:shard-{shard}-of-{shards}"


def placement_state_prefix() -> str:
    return f"{placement_prefix()}state/"


def placement_state_key(record: str) -> str:
    """``record`` is "meta", "groups/<group_id>", "jobs/<job_id>" or "nodes/<node_id>"."""
    kind, _, name = record.partition("/")
    if kind == "meta" and not name:
        return placement_state_prefix() + "meta"
    if kind not in ("groups", "jobs", "nodes"):
        raise ValueError(f"placement record {record!r} must be meta, groups/<id>, jobs/<id> "
                         "or nodes/<id>")
    return f"{placement_state_prefix()}{kind}/{_segment(name, kind[:-1] + ' id')}"


def placement_node_key(node_id: str) -> str:
    """What a node placed in a co-execution group runs: {"pool", "group", "turn", "holder"}
    (``turn``: the job whose phase the node runs now or next; ``holder``: the job holding its
    permit, or null). Written by the scheduler with its state, in the same transaction; a
    rollout worker started with ``--placement-node`` serves the ``turn`` job (WEAVE §5.1)."""
    return placement_state_key(f"nodes/{node_id}")


def placement_alive_prefix() -> str:
    return f"{placement_prefix()}alive/"


def placement_alive_key(job_id: str) -> str:
    return placement_alive_prefix() + _segment(job_id, "job id")


def lending_prefix() -> str:
    return f"{ROOT}/lending/"


def lending_key(coexec_id: str) -> str:
    """Who borrowed serving co-executor ``coexec_id``: {"job": str, "manager": str}, created
    only if absent (one job per co-executor) and attached to the claiming manager's lease, so
    it goes when the manager does (ROSE §5)."""
    return lending_prefix() + _segment(coexec_id, "co-executor id")
