"""Prometheus metrics of a rollout manager."""

from prometheus_client import Counter, Gauge, Histogram

from rlharvest.services.rollout_manager.remote_timing import RemoteStepTimings

IN_FLIGHT = Gauge("rlh_manager_in_flight_requests", "Requests not finished yet")
WAITING = Gauge("rlh_manager_waiting_requests", "Requests held in the manager (no worker)")
ASSIGNED = Gauge("rlh_manager_assigned_requests", "Requests assigned per worker", ["worker"])
PENDING = Gauge("rlh_manager_pending_requests", "Pending (queued) requests per worker", ["worker"])
INSTANCE_CAP = Gauge("rlh_manager_instance_cap", "N_prem: spot workers that may take work "
                     "(-1: no cap); the rest stand by")
MIGRATIONS = Counter("rlh_manager_migrations_total", "Requests moved between workers", ["cause"])
TICK_SECONDS = Histogram("rlh_manager_tick_seconds", "One tick of the core (Algorithm 2's "
                         "dispatch and rebalance) and carrying out its commands: the event loop "
                         "serves no worker meanwhile", buckets=(.0005, .001, .002, .005, .01, .02,
                                                                .05, .1, .2, .5, 1, 2, 5))
WITHDRAWN = Counter("rlh_manager_withdrawn_total", "Queued requests a sharded job's client moved "
                    "to another shard (Withdraw)")
TOKENS = Counter("rlh_manager_tokens_total", "Tokens accepted from workers")
TURNS_ROUTED = Gauge("rlh_manager_turns_routed", "Trajectory turns routed since start, by "
                     "outcome: affinity (to the worker holding the history), moved (that worker "
                     "was full or gone), first (no history anywhere yet)", ["outcome"])
TRAJECTORIES = Gauge("rlh_manager_trajectories", "Trajectories with a live affinity entry")
TOKENS_REGENERATED = Gauge("rlh_manager_tokens_regenerated", "Tokens generated twice (must stay 0)")
TOKENS_DROPPED = Counter("rlh_manager_tokens_dropped_total", "Deltas refused", ["reason"])
TOKENS_PER_SECOND = Gauge("rlh_manager_tokens_per_second", "Token rate over the last seconds")
COMPLETIONS = Counter("rlh_manager_completions_total", "Finished requests", ["outcome"])
WORKERS = Gauge("rlh_manager_workers", "Workers known to the manager", ["state"])
STEPS = Counter("rlh_manager_steps_total", "Steps submitted", ["outcome"])
REMOTE_SECONDS = Gauge("rlh_manager_step_remote_seconds", "Last finished step, mean per remote "
                       "instance: t_remote (first to last tokens), t_remote_wait (idle after)",
                       ["phase"])
REMOTE_INSTANCES = Gauge("rlh_manager_step_remote_instances", "Last finished step: mean "
                         "(time-weighted) and next count of active remote instances", ["at"])


def observe_remote(timings: RemoteStepTimings) -> None:
    REMOTE_SECONDS.labels("busy").set(timings.t_remote)
    REMOTE_SECONDS.labels("wait").set(timings.t_remote_wait)
    REMOTE_INSTANCES.labels("mean").set(timings.n_prem_mean)
    REMOTE_INSTANCES.labels("next").set(timings.n_prem_next)
SERVING_WORKERS = Gauge("rlh_manager_serving_workers_claimed", "Serving co-executors this "
                        "manager's job has borrowed (ROSE §5; at most max_serving_workers)")
SERVING_CLAIMS = Counter("rlh_manager_serving_claims_total", "Lending claims by outcome",
                         ["outcome"])  # claimed | lost_race | released
TOKENS_DISCARDED = Counter("rlh_manager_tokens_discarded_total", "Tokens of requests a step's "
                           "policy cancelled (tail batching: deferred or surplus responses; "
                           "regenerated on-policy later, never trained)")
TP_PLAN = Gauge("rlh_manager_tp_plan", "RollPacker's TP plan (--tp-planner, advisory): the TP "
                "size of the next round of each kind (short: tail batching's short rounds; long: "
                "every other step)", ["kind"])
PREEMPTIONS = Counter("rlh_manager_preemptions_total", "KV preemptions the job's workers reported "
                      "(increases of their Load.preemptions totals; a worker's first total is its "
                      "baseline)")
STREAM_SCALE_DOWNS = Counter("rlh_manager_stream_scale_downs_total", "Stream-trainer scale-downs "
                             "(--stream-scaling): steps whose least-loaded half of the rollout "
                             "workers was lent to training at a 20-50% milestone")
WORKERS_LENT = Gauge("rlh_manager_workers_lent_to_training", "Rollout workers lent to training by "
                     "stream-trainer scaling now: they hold no request until their step ends")
SEED_WINDOWS = Counter("rlh_manager_seed_windows_total", "Steps whose seed workers (the trainer's "
                       "engine) rolled out in a seeding window (RLBoost §4.1)")
SEED_RECALLS = Counter("rlh_manager_seed_recalls_total", "Closed seeding windows whose seed "
                       "workers took their step back: the last remote worker was lost")
SEED_HANDOFFS = Counter("rlh_manager_seed_handoffs_total", "Requests handed from seed workers to "
                        "remote workers, tokens kept, when a seeding window closed")
LEADER = Gauge("rlh_manager_leader", "1 while this manager leads its job (0: a standby)")
STEP_REATTACHES = Counter("rlh_manager_step_reattaches_total", "Steps a client submitted "
                          "again after going away (a restarted trainer) and got back whole")
STEPS_DETACHED = Gauge("rlh_manager_steps_detached", "Steps whose client went away, kept for "
                       "it to re-attach (--reattach-grace-s)")
