# Prometheus for the compose stack from Debian's package. The package pulls its web console's
# JavaScript libraries (218 MB): the final image takes only the binaries, so it scrapes, keeps
# the series, evaluates the rules and serves the API (/api/v1/...) that Grafana and the tests
# query, but not the browser UI (use prom/prometheus for that). wget is its health check. The
# entrypoint is the binary, as in prom/prometheus, so deploy/prometheus/compose.yml applies to
# either image. BASE: debian:bookworm-slim on a machine that reaches Docker Hub, or the base that
# `make image` bootstraps (the build then reaches Debian's mirrors over the host's network).
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS package
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

FROM ${BASE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc /usr/share/man
COPY --from=package /usr/bin/prometheus /usr/bin/
RUN mkdir -p /etc/prometheus /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
