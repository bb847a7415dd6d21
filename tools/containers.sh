#!/usr/bin/env bash
# The container path, offline: `make image` and `make test-containers` (docs/operations/deploy.md).
#
#   tools/containers.sh images   the Debian base (debootstrap), etcd and Prometheus from Debian's
#                                packages, rlharvest:latest from a wheelhouse made on the host
#   tools/containers.sh stage    the images, then the compose stack's test (tests/containers)
#
# A container engine: a running Docker, else Debian's docker.io started here as
# `dockerd --iptables=false` (and stopped again at the end). Compose: `docker compose` where it is
# v2.20 or newer (`include:`), else Docker Compose v2 from Debian's docker-compose package of the
# next release (trixie: 2.26), unpacked under build/containers. Where no engine can start, `stage`
# says why and exits 0: the stage is skipped, not failed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
OUT=build/containers
WHEELHOUSE=$OUT/wheelhouse
# Outlives a clone (CI's is fresh each run): what takes minutes to build and never changes.
CACHE=${RLH_CONTAINER_CACHE:-/var/cache/rlharvest-containers}
BASE_IMAGE=rlharvest-debian:$SUITE
COMPOSE_SUITE=trixie  # the first Debian release whose docker-compose is Compose v2
SUDO=$([ "$(id -u)" != 0 ] && command -v sudo >/dev/null && echo sudo || true)
STARTED_DOCKERD=""

say() { echo "containers: $*" >&2; }
skip() { echo "test-containers: skipped: $*"; exit 0; }
timed() { local t0=$SECONDS; "$@"; say "$1 ${2:-}: $((SECONDS - t0)) s"; }

apt_install() {  # packages, installed with apt where missing
  command -v apt-get >/dev/null || return 1
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
}

# --- the engine ------------------------------------------------------------------------------
engine() {  # a Docker engine this shell can use; 1 with the reason on stderr when none can run
  docker info >/dev/null 2>&1 && return 0
  if ! command -v dockerd >/dev/null; then
    apt_install docker.io >/dev/null || { say "docker.io did not install"; return 1; }
  fi
  mkdir -p "$OUT"
  # No iptables here: containers reach each other on the compose network, and published ports
  # go through docker-proxy on the host. Nothing in a container needs the outside.
  $SUDO dockerd --iptables=false >"$OUT/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { say "started dockerd (pid $STARTED_DOCKERD)"; return 0; }
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
    sleep 1
  done
  say "dockerd did not start: $(tail -n 3 "$OUT/dockerd.log" | tr '\n' ' ')"
  stop_engine
  return 1
}

stop_engine() {
  [ -n "$STARTED_DOCKERD" ] || return 0
  $SUDO kill "$STARTED_DOCKERD" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
  STARTED_DOCKERD=""
}

# --- Compose v2 --------------------------------------------------------------------------------
compose_command() {  # prints the Compose v2 command line to use
  local v
  v=$(docker compose version --short 2>/dev/null || true)
  if [ -n "$v" ] && printf '2.20\n%s\n' "${v#v}" | sort -V -C; then
    echo "docker compose"; return 0
  fi
  local plugin=$OUT/compose/usr/libexec/docker/cli-plugins/docker-compose
  if [ ! -x "$plugin" ]; then
    local apt_dir=$OUT/compose-apt
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$OUT/compose"
    echo "deb $MIRROR $COMPOSE_SUITE main" >"$apt_dir/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$PWD/$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
                -o "Dir::State::Lists=$PWD/$apt_dir/lists" -o "Dir::Cache=$PWD/$apt_dir"
                -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
    apt-get "${opts[@]}" update -qq >&2
    (cd "$apt_dir/archives" && apt-get "${opts[@]}" download docker-compose >&2)
    dpkg -x "$apt_dir"/archives/docker-compose_*.deb "$OUT/compose"
  fi
  echo "$PWD/$plugin"
}

# --- the images --------------------------------------------------------------------------------
base_image() {  # Debian $SUITE from Debian's mirror, with Python and its venv module
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && { say "$BASE_IMAGE is there"; return 0; }
  command -v debootstrap >/dev/null || apt_install debootstrap
  local root=$OUT/rootfs-$SUITE
  rm -rf "$root"
  nice -n 10 $SUDO debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$root" \
    "$MIRROR" >"$OUT/debootstrap.log" 2>&1 || { tail -n 20 "$OUT/debootstrap.log"; return 1; }
  # What a container never reads: the downloaded packages, the lists, docs, manuals, locales.
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
  $SUDO tar -C "$root" --numeric-owner -c . | docker import -q \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  $SUDO rm -rf "$root"
}

wheelhouse() {  # the wheel of every dependency, made here (the image's build reaches no index)
  mkdir -p "$WHEELHOUSE" "$CACHE"
  # torch pinned: 2.13.0 is the local CPU build (an unpinned torch resolves to a CUDA build);
  # setuptools builds the package from its sources in the image.
  nice -n 10 "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELHOUSE" torch==2.13.0 "setuptools>=68" . \
    >"$OUT/pip-wheel.log" 2>&1 || { grep -v "is ignored: it is neither" "$OUT/pip-wheel.log"; return 1; }
  # The package itself is not a dependency: the image builds it from the sources, in a layer
  # after the dependencies' (which a rebuild then reuses).
  rm -f "$WHEELHOUSE"/rlharvest-*.whl
  # DeepSpeed's CPU all-reduce op (deepspeed_shm_comm), which the trainer loads, is compiled at
  # its first use unless the wheel carries it: built here once (a few minutes; a compiler and
  # torch 2.13 on the host), kept in $CACHE, and put in the wheelhouse in place of the pure one,
  # so the image needs no compiler.
  local ds version
  ds=$(ls "$WHEELHOUSE"/deepspeed-*-py3-none-any.whl 2>/dev/null || true)
  [ -n "$ds" ] || return 0
  version=$(basename "$ds" | cut -d- -f2)
  if ! ls "$CACHE"/deepspeed-"$version"-cp*-linux_x86_64.whl >/dev/null 2>&1; then
    command -v c++ >/dev/null || apt_install g++ >/dev/null
    say "building deepspeed $version with its CPU op (once; kept in $CACHE)"
    DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu nice -n 10 "$PYTHON" -m pip wheel -q \
      --no-deps --no-build-isolation --no-binary deepspeed --no-cache-dir --wheel-dir "$CACHE" \
      "deepspeed==$version" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  fi
  rm -f "$ds"
  cp "$CACHE"/deepspeed-"$version"-cp*-linux_x86_64.whl "$WHEELHOUSE"/
}

build() {  # tag dockerfile context [docker build flags]
  local tag=$1 file=$2 context=$3; shift 3
  local log="$OUT/build-${tag/:/-}.log"
  nice -n 10 docker build -q -f "$file" -t "$tag" "$@" "$context" >"$log" 2>&1 \
    || { tail -n 30 "$log"; return 1; }
}

images() {
  mkdir -p "$OUT"
  timed base_image
  # etcd and Prometheus: apt inside the build, over the host's network (the mirrors are reachable,
  # the build's own network is not: dockerd runs without iptables).
  timed build rlharvest-etcd:"$SUITE" deploy/images/etcd.Dockerfile deploy/images \
    --network=host --build-arg BASE="$BASE_IMAGE"
  # Each multi-stage build's first stage is tagged too (…:build): an untagged stage would be
  # pruned below, and with it the cache of its layers (the image's dependencies, ~1 GB).
  local args=(--network=host --build-arg BASE="$BASE_IMAGE")
  timed build rlharvest-prometheus:build deploy/images/prometheus.Dockerfile deploy/images \
    --target package "${args[@]}"
  timed build rlharvest-prometheus:"$SUITE" deploy/images/prometheus.Dockerfile deploy/images \
    "${args[@]}"
  [ -n "${WHEELHOUSE_MADE:-}" ] || timed wheelhouse
  args=(--build-arg BASE="$BASE_IMAGE" --build-arg WHEELHOUSE="$WHEELHOUSE")
  timed build rlharvest:build deploy/Dockerfile . --target build "${args[@]}"
  timed build rlharvest:latest deploy/Dockerfile . "${args[@]}"
  docker image prune -f >/dev/null  # earlier builds' images, now untagged
  docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^rlharvest(-etcd|-prometheus|-debian)?:" | grep -v ":build " >&2
}

case "${1:-}" in
  images)
    engine || { say "no container engine can start here"; exit 1; }
    trap stop_engine EXIT
    images
    ;;
  stage)
    t0=$SECONDS
    timed wheelhouse
    WHEELHOUSE_MADE=1
    # The wheel in a fresh venv outside the checkout: no engine needed.
    RLH_CONTAINER_STAGE=1 RLH_WHEELHOUSE="$PWD/$WHEELHOUSE" \
      "$PYTHON" -m pytest -q -ra -p no:cacheprovider --timeout 900 tests/containers/test_wheel.py
    engine || skip "no container engine can start here (see above); the wheel passed"
    trap stop_engine EXIT
    images
    RLH_COMPOSE=$(compose_command)
    say "compose: $RLH_COMPOSE ($($RLH_COMPOSE version --short))"
    RLH_CONTAINER_STAGE=1 RLH_COMPOSE="$RLH_COMPOSE" "$PYTHON" -m pytest -q -ra -s \
      -p no:cacheprovider --timeout 900 tests/containers/test_compose_stack.py
    say "the container stage took $((SECONDS - t0)) s"
    ;;
  compose) compose_command ;;
  *) echo "usage: $0 images|stage|compose" >&2; exit 2 ;;
esac
