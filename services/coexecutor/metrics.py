"""Prometheus metrics of the co-executor's serving side (one per process: the default registry)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30)
REQUESTS = Counter("rlh_coexec_serving_requests_total", "Serving HTTP requests answered",
                   ["outcome"])  # ok | bad_request | overloaded | too_large | aborted | error
TTFT = Histogram("rlh_coexec_serving_ttft_seconds", "Time to first token, from the request "
                 "reaching the engine side", buckets=_LATENCY)
TPOT = Histogram("rlh_coexec_serving_tpot_seconds", "Time per output token after the first, "
                 "per request", buckets=_LATENCY)
TOKENS = Counter("rlh_coexec_serving_tokens_total", "Serving tokens generated")
IN_FLIGHT = Gauge("rlh_coexec_serving_in_flight", "Serving requests in the engine")
