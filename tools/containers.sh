#!/usr/bin/env bash
# The container path, offline: `make image` and `make test-containers` (docs/operations/deploy.md).
#
#   tools/containers.sh images          the Debian base (debootstrap), etcd and Prometheus from
#                                       Debian's packages, rlharvest:latest from a wheelhouse
#                                       made on the host
#   tools/containers.sh stage [PART]    the wheel's test (a fresh venv, no engine) and the
#                                       compose stack's test on the images (tests/containers);
#                                       PART `wheel` or `compose` runs one of them alone
#
# A container engine: a running Docker, else Debian's docker.io started here as
# `dockerd --iptables=false` (and stopped again at the end). Compose: `docker compose` where it is
# v2.20 or newer (`include:`), else Docker Compose v2 from Debian's docker-compose package of the
# next release (trixie: 2.26), unpacked under build/containers. Where no engine can start, `stage`
# says why and exits 0: the compose part is skipped, not failed.
#
# What is independent runs at once: the base image, then the etcd, Prometheus and rlharvest
# images, build in the background while the wheelhouse is made and the wheel's test runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
OUT=${RLH_CONTAINER_OUT:-build/containers}  # logs, the wheelhouse, Compose
WHEELHOUSE=$OUT/wheelhouse
WHEELHOUSE_DONE=$OUT/wheelhouse.done  # "ok" or "failed" once the wheelhouse step ended
BASE_IMAGE=rlharvest-debian:$SUITE
COMPOSE_SUITE=trixie  # the first Debian release whose docker-compose is Compose v2
SUDO=$([ "$(id -u)" != 0 ] && command -v sudo >/dev/null && echo sudo || true)
STARTED_DOCKERD=""
BACKGROUND=""  # the images' job, while it runs

say() { echo "containers: $*" >&2; }
skip() { echo "test-containers: skipped: $*"; exit 0; }
timed() {  # a step, its time said; its status kept (also where set -e does not apply)
  local t0=$SECONDS rc=0
  "$@" || rc=$?
  say "$1 ${2:-}: $((SECONDS - t0)) s"
  return $rc
}

apt_install() {  # packages, installed with apt where missing
  command -v apt-get >/dev/null || return 1
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
}

# --- the engine ------------------------------------------------------------------------------
engine() {  # a Docker engine this shell can use; 1 with the reason on stderr when none can run
  docker info >/dev/null 2>&1 && return 0
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    apt_install docker.io >/dev/null || {
      say "no docker and dockerd on PATH, and Debian's docker.io did not install"; return 1; }
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

kill_tree() {  # a process this script started, and what it started
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

cleanup() {  # on exit: the images' job if it still runs (a failure elsewhere), then the engine
  [ -z "$BACKGROUND" ] || { kill_tree "$BACKGROUND"; wait "$BACKGROUND" || true; }
  stop_engine
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

# --- the wheelhouse ----------------------------------------------------------------------------
wheelhouse() {  # the wheel of every dependency and of the package, made here from pip's indexes
  rm -rf "$WHEELHOUSE" && mkdir -p "$WHEELHOUSE"
  # torch pinned: 2.13.0 is the local CPU build (an unpinned torch resolves to a CUDA build).
  # DeepSpeed's wheel is the pure one: without a compiler the trainer does without its CPU
  # shared-memory op (rlharvest/services/trainer/device.py, skip_uncompilable_shm_op).
  "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELHOUSE" torch==2.13.0 . >"$OUT/pip-wheel.log" 2>&1 \
    || { grep -v "is ignored: it is neither" "$OUT/pip-wheel.log"; return 1; }
  # What the image's two layers install (name==version, from the wheels' names): the
  # dependencies, then the package, each keyed by its hash (deploy/images/rlharvest.Dockerfile).
  (cd "$WHEELHOUSE" && ls ./*.whl | sed -E 's|^\./([^-]+)-([^-]+)-.*|\1==\2|' | sort >all.txt \
    && grep -v '^rlharvest==' all.txt >deps.txt && grep '^rlharvest==' all.txt >package.txt \
    && rm all.txt)
}

mark_wheelhouse() {  # runs the wheelhouse step and says how it ended to the images' job
  rm -f "$WHEELHOUSE_DONE"
  if timed wheelhouse; then echo ok >"$WHEELHOUSE_DONE"; else echo failed >"$WHEELHOUSE_DONE"; return 1; fi
}

# --- the images --------------------------------------------------------------------------------
base_image() {  # Debian $SUITE from Debian's mirror, with Python and its venv module
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && { say "$BASE_IMAGE is there"; return 0; }
  command -v debootstrap >/dev/null || apt_install debootstrap >/dev/null
  local root=$OUT/rootfs-$SUITE
  $SUDO rm -rf "$root"
  $SUDO debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$root" \
    "$MIRROR" >"$OUT/debootstrap.log" 2>&1 || { tail -n 20 "$OUT/debootstrap.log"; return 1; }
  # What a container never reads: the downloaded packages, the lists, docs, manuals, locales.
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
  $SUDO tar -C "$root" --numeric-owner -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null  # (no --quiet: the image's id on stdout)
  $SUDO rm -rf "$root"
}

build() {  # tag dockerfile context [docker build flags]
  local tag=$1 file=$2 context=$3; shift 3
  local log="$OUT/build-${tag/:/-}.log"
  docker build -q -f "$file" -t "$tag" "$@" "$context" >"$log" 2>&1 \
    || { tail -n 30 "$log"; return 1; }
}

debian_images() {  # etcd and Prometheus: apt inside the build, over the host's network (the
  # mirrors are reachable, the build's own network is not: dockerd runs without iptables)
  local args=(--network=host --build-arg BASE="$BASE_IMAGE")
  compose_command >/dev/null  # Compose, if it must be fetched: the network is idle here
  timed build rlharvest-etcd:"$SUITE" deploy/images/etcd.Dockerfile deploy/images "${args[@]}"
  # The multi-stage build's first stage is tagged too (…:build): an untagged stage would be
  # pruned below, and with it the cache of its layers.
  timed build rlharvest-prometheus:build deploy/images/prometheus.Dockerfile deploy/images \
    --target package "${args[@]}"
  timed build rlharvest-prometheus:"$SUITE" deploy/images/prometheus.Dockerfile deploy/images \
    "${args[@]}"
}

rlharvest_image() {  # from the wheelhouse, once it is made, served over HTTP to the build
  until [ -s "$WHEELHOUSE_DONE" ]; do sleep 1; done
  [ "$(cat "$WHEELHOUSE_DONE")" = ok ] || { say "no wheelhouse: rlharvest:latest not built"; return 1; }
  # A fixed port: the URL is a build argument, and the builder keys the layers' cache on it.
  local port=${RLH_WHEEL_PORT:-38471} server status=0
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" \
    >"$OUT/wheel-server.log" 2>&1 &
  server=$!
  for _ in $(seq 30); do
    "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/deps.txt')" \
      2>/dev/null && break
    kill -0 "$server" 2>/dev/null \
      || { say "the wheelhouse's server did not start (port $port taken? set RLH_WHEEL_PORT)"; return 1; }
    sleep 1
  done
  # The build context is an empty folder: the Dockerfile copies nothing in.
  mkdir -p "$OUT/empty"
  timed build rlharvest:latest deploy/images/rlharvest.Dockerfile "$OUT/empty" --network=host \
    --build-arg BASE="$BASE_IMAGE" --build-arg WHEELS="http://127.0.0.1:$port" \
    --build-arg DEPS_ID="$(sha256sum "$WHEELHOUSE"/deps.txt | cut -c1-16)" \
    --build-arg PACKAGE_ID="$(sha256sum "$WHEELHOUSE"/rlharvest-*.whl | cut -c1-16)" || status=1
  kill "$server" 2>/dev/null || true
  return $status
}

images() {  # every image; the rlharvest one waits for the wheelhouse (mark_wheelhouse)
  mkdir -p "$OUT"
  timed base_image
  local debian rlharvest
  debian_images & debian=$!
  rlharvest_image & rlharvest=$!
  wait "$debian" && wait "$rlharvest" || { wait; return 1; }
  docker image prune -f >/dev/null  # earlier builds' images, now untagged
  docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^rlharvest(-etcd|-prometheus|-debian)?:" | grep -v ":build " >&2
}

images_in_background() {
  images & BACKGROUND=$!
}

wait_images() {
  local job=$BACKGROUND
  BACKGROUND=""
  wait "$job"
}

wheel_test() {  # the wheel in a fresh venv outside the checkout: no engine needed
  RLH_CONTAINER_STAGE=1 RLH_WHEELHOUSE="$PWD/$WHEELHOUSE" \
    "$PYTHON" -m pytest -q -ra -p no:cacheprovider --timeout 900 tests/containers/test_wheel.py
}

compose_test() {
  local compose
  compose=$(compose_command)
  say "compose: $compose ($($compose version --short))"
  RLH_CONTAINER_STAGE=1 RLH_COMPOSE="$compose" "$PYTHON" -m pytest -q -ra -s \
    -p no:cacheprovider --timeout 900 tests/containers/test_compose_stack.py
}

stage() {  # PART: all (default), wheel or compose
  local part=${1:-all} t0=$SECONDS have_engine=1
  case "$part" in all|wheel|compose) ;; *) echo "stage: PART is wheel or compose" >&2; exit 2;; esac
  mkdir -p "$OUT"
  if [ "$part" != wheel ]; then
    engine || have_engine=0
    [ "$have_engine" = 1 ] || [ "$part" = all ] || skip "no container engine can start here (see above)"
    trap cleanup EXIT
    [ "$have_engine" = 0 ] || images_in_background
  fi
  mark_wheelhouse
  if [ "$part" != compose ]; then timed wheel_test; fi
  [ "$have_engine" = 1 ] || skip "no container engine can start here (see above); the wheel passed"
  if [ "$part" != wheel ]; then
    wait_images
    timed compose_test
  fi
  say "the container stage took $((SECONDS - t0)) s"
}

case "${1:-}" in
  images)
    mkdir -p "$OUT"
    engine || { say "no container engine can start here"; exit 1; }
    trap cleanup EXIT
    images_in_background
    mark_wheelhouse
    wait_images
    ;;
  stage) stage "${2:-all}" ;;
  compose) compose_command ;;
  *) echo "usage: $0 images|stage [wheel|compose]|compose" >&2; exit 2 ;;
esac
