# etcd for the compose stack from Debian's packages (etcd-server, etcd-client for the health
# check). BASE: debian:bookworm-slim on a machine that reaches Docker Hub, or the base that
# `make image` bootstraps (the build then reaches Debian's mirrors over the host's network).
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         etcd-server etcd-client \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc /usr/share/man
EXPOSE 2379
CMD ["etcd"]
