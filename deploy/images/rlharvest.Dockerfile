# rlharvest:latest where no image registry is reachable (`make image`, tools/containers.sh): on
# the Debian base it bootstraps, every wheel from the wheelhouse it made on the host, which it
# serves over HTTP for the build's time (`docker build --network=host`). One stage, and the wheels
# never enter it: no COPY of a gigabyte of wheels, no second copy of the venv between stages, no
# build context to send. No compiler and no sources in the image. deploy/Dockerfile builds the
# same image from a registry's base and the package indexes.
ARG BASE=rlharvest-debian:bookworm
FROM ${BASE}
# WHEELS: the wheelhouse's URL (pip's --find-links). DEPS_ID and PACKAGE_ID: hashes of what the
# two layers install. The classic builder keys a RUN on its text and its build arguments alone,
# so a changed wheel rebuilds its layer, and an unchanged dependencies' layer is reused.
ARG WHEELS
ARG DEPS_ID
# The dependencies first (deps.txt: one name==version a wheel, the package's own left out).
# Compiled to bytecode here, once: else each container compiles torch's modules at its start.
RUN python3 -m venv /opt/rlharvest \
    && /opt/rlharvest/bin/pip install -q --no-cache-dir --no-index --no-deps \
         --find-links "$WHEELS" -r "$WHEELS/deps.txt"
ARG PACKAGE_ID
RUN /opt/rlharvest/bin/pip install -q --no-cache-dir --no-index --no-deps \
         --find-links "$WHEELS" -r "$WHEELS/package.txt" \
    && /opt/rlharvest/bin/pip uninstall -y -q pip
ENV PATH=/opt/rlharvest/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /var/lib/rlharvest
