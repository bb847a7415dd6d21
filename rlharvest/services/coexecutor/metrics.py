"""Prometheus metrics of the co-executor's serving side (one per process: the default registry)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30)
REQUESTS = Counter("rlh_coexec_serving_requests_total", "Serving HTTP requests answered",
                   ["outcome"])  # ok | bad_request | overloaded | unavailable | too_large | aborted | error
TTFT = Histogram("rlh_coexec_serving_ttft_seconds", "Time to first token, from the request "
                 "reaching the engine side", buckets=_LATENCY)
TPOT = Histogram("rlh_coexec_serving_tpot_seconds", "Time per output token after the first, "
                 "per request", buckets=_LATENCY)
TOKENS = Counter("rlh_coexec_serving_tokens_total", "Serving tokens generated")
IN_FLIGHT = Gauge("rlh_coexec_serving_in_flight", "Serving requests in the engine")
SLO = Counter("rlh_coexec_serving_slo_total", "Finished serving requests by whether they met "
              "both SLOs (TTFT and TPOT)", ["met"])  # yes | no
TICKS = Counter("rlh_coexec_ticks_total", "Scheduler ticks by the forward they ran", ["action"])
PAGES = Gauge("rlh_coexec_pages", "KV pool pages by state", ["state"])
ROLLOUT_BUDGET = Gauge("rlh_coexec_rollout_budget_pages", "B_roll: pages rollout may hold")
PRESSURE = Gauge("rlh_coexec_memory_pressure", "1 while serving's burst froze B_roll")
PRESSURE_EVENTS = Counter("rlh_coexec_pressure_events_total", "Burst cuts of B_roll")
ROLLOUT_ABORTS = Counter("rlh_coexec_rollout_aborts_total", "Rollout requests aborted back to "
                         "the manager", ["cause"])  # memory_pressure | budget | lease | stall
ROLLOUT_TOKENS = Counter("rlh_coexec_rollout_tokens_total", "Rollout tokens generated here")
PREFIXES_DROPPED = Counter("rlh_coexec_parked_prefixes_dropped_total", "Parked rollout "
                           "prefixes (finished requests' KV kept for the next turn) freed before "
                           "a turn adopted them", ["cause"])  # lease | memory_pressure | ...
LENT = Gauge("rlh_coexec_lent", "1 while lent to an RL job (its rollouts run here)")
LENDING_CHANGES = Counter("rlh_coexec_lending_changes_total", "Lent to a job / returned",
                          ["change"])
SERVING_QUEUED = Counter("rlh_coexec_serving_queued_total", "Serving requests that waited for "
                         "KV pages (the whole pool was in use)")
SERVING_PREEMPTED = Counter("rlh_coexec_serving_preempted_total", "Serving requests recomputed "
                            "(left the engine, re-prefilled later) so another one could grow")
