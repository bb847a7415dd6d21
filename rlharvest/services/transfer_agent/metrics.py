"""Prometheus metrics of a transfer agent (one agent per process, so the default registry)."""

from prometheus_client import Counter, Gauge, Histogram

BYTES_IN = Counter("rlh_agent_bytes_in_total", "Weight bytes received", ["source"])  # publish|relay
BYTES_OUT = Counter("rlh_agent_bytes_out_total", "Weight bytes served to pulls", ["link"])  # local|cross
VERSIONS_HELD = Gauge("rlh_agent_versions_held", "Weight versions held", ["job"])
HELD_BYTES = Gauge("rlh_agent_held_bytes", "Host memory held by weight versions", ["job"])
LATEST = Gauge("rlh_agent_latest_version", "Latest version held", ["job"])
JOBS_DROPPED = Counter("rlh_agent_jobs_dropped_total", "Jobs dropped after job_idle_s without a "
                       "publish, relay or pull")
PUBLISHES = Counter("rlh_agent_publishes_total", "Publishes", ["outcome"])
EVICTIONS = Counter("rlh_agent_evictions_total", "Versions evicted", ["reason"])
PULLS = Counter("rlh_agent_pulls_total", "Pull plans served", ["kind"])  # dense|delta|noop
PLAN_SECONDS = Histogram("rlh_agent_plan_seconds", "Time to plan + encode a pull",
                         buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
BUCKET_SECONDS = Histogram("rlh_agent_bucket_stream_seconds", "Time to stream one buckets request",
                           buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120))
DELTA_RATIO = Gauge("rlh_agent_delta_ratio", "Payload / dense bytes of the last delta pull plan")
REFUSED = Counter("rlh_agent_refused_total", "RPCs refused", ["rpc", "code"])
RELAYS = Counter("rlh_agent_relays_total", "Versions sourced from another agent", ["link"])
RELAY_BYTES_FROM = Counter("rlh_agent_relay_bytes_from_total", "Relay bytes received, per "
                           "source agent (a scattered pull has several)", ["agent"])
CORRUPTED = Counter("rlh_agent_fault_corrupted_chunks_total", "Chunks corrupted on purpose "
                    "(fault_corrupt_chunks test hook)")
