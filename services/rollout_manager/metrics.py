"""Prometheus metrics of a rollout manager."""

from prometheus_client import Counter, Gauge

IN_FLIGHT = Gauge("rlh_manager_in_flight_requests", "Requests not finished yet")
WAITING = Gauge("rlh_manager_waiting_requests", "Requests held in the manager (no worker)")
ASSIGNED = Gauge("rlh_manager_assigned_requests", "Requests assigned per worker", ["worker"])
PENDING = Gauge("rlh_manager_pending_requests", "Pending (queued) requests per worker", ["worker"])
INSTANCE_CAP = Gauge("rlh_manager_instance_cap", "N_prem: spot workers that may take work "
                     "(-1: no cap); the rest stand by")
MIGRATIONS = Counter("rlh_manager_migrations_total", "Requests moved between workers", ["cause"])
TOKENS = Counter("rlh_manager_tokens_total", "Tokens accepted from workers")
TOKENS_REGENERATED = Gauge("rlh_manager_tokens_regenerated", "Tokens generated twice (must stay 0)")
TOKENS_DROPPED = Counter("rlh_manager_tokens_dropped_total", "Deltas refused", ["reason"])
TOKENS_PER_SECOND = Gauge("rlh_manager_tokens_per_second", "Token rate over the last seconds")
COMPLETIONS = Counter("rlh_manager_completions_total", "Finished requests", ["outcome"])
WORKERS = Gauge("rlh_manager_workers", "Workers known to the manager", ["state"])
STEPS = Counter("rlh_manager_steps_total", "Steps submitted", ["outcome"])
