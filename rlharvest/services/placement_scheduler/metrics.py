"""Prometheus metrics of the placement scheduler."""

from prometheus_client import Counter, Gauge, Histogram

LEADER = Gauge("rlh_placement_leader", "1 while this scheduler leads, 0 while it stands by")
GROUPS = Gauge("rlh_placement_groups", "Co-execution groups")
JOBS = Gauge("rlh_placement_jobs", "Placed jobs")
POOL_NODES = Gauge("rlh_placement_pool_nodes", "Nodes per pool and state (free, allocated to a "
                   "group, busy under a permit)", ["pool", "state"])
POOL_UTILISATION = Gauge("rlh_placement_pool_utilisation",
                         "Share of the pool's allocated nodes running a phase now", ["pool"])
COST = Gauge("rlh_placement_cost_per_hour", "Provisioned cost of all groups, $/hour")
SUBMISSIONS = Counter("rlh_placement_submissions_total", "SubmitJob outcomes "
                      "(strategy when placed, else the refusal)", ["outcome"])
DEPARTURES = Counter("rlh_placement_departures_total", "Jobs that left their group", ["cause"])
DECISION_SECONDS = Histogram("rlh_placement_decision_seconds", "Algorithm 1 running time",
                             buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3))
ADMISSION_BATCH = Histogram("rlh_placement_admission_batch_jobs", "Jobs admitted together "
                            "per admission window (--admission-window-s)",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128))
PERMITS = Counter("rlh_placement_permits_total", "Permits granted / released", ["phase", "event"])
TAIL_MIGRATIONS = Gauge("rlh_placement_tail_migrations", "Long-tail migrations triggered")
CONSOLIDATION_MOVES = Gauge("rlh_placement_consolidation_moves", "Jobs moved to another group "
                            "when a departure thinned theirs (--consolidate)")
BUBBLES_RECLAIMED = Gauge("rlh_placement_bubble_node_seconds_reclaimed",
                          "Node-seconds handed to the next rollout before a migrated tail ended")
SLO_ATTAINMENT = Gauge("rlh_placement_slo_attainment",
                       "Share of measured iterations within SLO x T_solo")
ETCD_WRITE_SECONDS = Histogram("rlh_placement_etcd_write_seconds", "State transaction latency",
                               buckets=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3))
