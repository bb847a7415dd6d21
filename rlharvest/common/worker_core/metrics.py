"""Prometheus metrics of the worker core (one worker per process, so the default registry)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS_ADDED = Counter("rlh_worker_requests_added_total", "Requests accepted", ["resumed"])
REQUESTS_FINISHED = Counter("rlh_worker_requests_finished_total", "Requests finished", ["reason"])
COMMAND_ERRORS = Counter("rlh_worker_command_errors_total", "Refused commands", ["code"])
TOKENS_GENERATED = Counter("rlh_worker_tokens_generated_total", "Tokens sampled")
PREFILL_TOKENS = Counter("rlh_worker_prefill_tokens_total", "Prompt + resumed tokens prefilled")
ENGINE_STEPS = Counter("rlh_worker_engine_steps_total", "Engine steps run")
STEP_SECONDS = Histogram("rlh_worker_step_seconds", "Wall time of one engine step",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
ABORT_WAIT_STEPS = Histogram(
    "rlh_worker_abort_wait_steps", "Engine steps completed between an abort's arrival and the "
    "request leaving the engine: at most 1, the step running when it arrived (a migration or a "
    "seeding window's close stops a request's token generation within one engine step)",
    buckets=(0, 1, 2, 3, 5))
PENDING = Gauge("rlh_worker_pending_requests", "Requests waiting for a batch slot")
EXECUTING = Gauge("rlh_worker_executing_requests", "Requests in the running batch")
KV_USED = Gauge("rlh_worker_kv_used_tokens", "KV cache tokens in use")
PREEMPTIONS = Counter("rlh_worker_preemptions_total",
                      "Requests preempted for KV memory and recomputed (RollPacker §4.2)")
PREFIX_LOOKUPS = Counter("rlh_worker_prefix_cache_lookups_total",
                         "Requests admitted with the prefix cache on")
PREFIX_HITS = Counter("rlh_worker_prefix_cache_hits_total",
                      "Requests that started after a cached prefix")
PREFIX_CACHED_TOKENS = Counter("rlh_worker_prefix_cache_saved_tokens_total",
                               "Prefill tokens skipped: read from cached KV pages")
PREFIX_PAGES = Gauge("rlh_worker_prefix_cache_pages", "KV pages the prefix cache holds")
WEIGHT_VERSION = Gauge("rlh_worker_weight_version", "Loaded weight version")
SESSIONS = Gauge("rlh_worker_sessions", "Open manager sessions")
DRAINING = Gauge("rlh_worker_draining", "1 while the worker drains before exit")
KEPT = Gauge("rlh_worker_requests_kept", "Requests of broken sessions (a manager died) kept "
             "running or finished for a successor manager to adopt")
KEPT_OUTCOMES = Counter("rlh_worker_kept_request_outcomes_total", "Kept requests by how they ended: "
                        "adopted by a successor, expired, refused by a manager, mismatched",
                        ["outcome"])
KEPT_TOKENS_ADOPTED = Counter("rlh_worker_kept_tokens_adopted_total", "Tokens a successor "
                              "manager lacked and got from a kept request instead of "
                              "generating them again")
KEPT_TOKENS_DROPPED = Counter("rlh_worker_kept_tokens_dropped_total", "Tokens of unfinished "
                              "kept requests dropped unadopted (expired, refused, mismatched): "
                              "generated again elsewhere")
