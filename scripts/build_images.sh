#!/usr/bin/env bash
# Builds every SinkFlex image on a machine that cannot pull from container registries
# (docs/deploy.md, "Building and running the stack without a registry"):
#
#   scripts/build_images.sh [--configure] [--rebuild-base] [--timings FILE] [IMAGE ...]
#
# IMAGE is any of: base redis env reward rollout-cpu learner-cpu (default: all of them, in
# that order). What it does:
#   base         a Debian 12 (bookworm) / Python 3.11 root filesystem made with debootstrap from
#                Debian's packages, imported as $BASE_IMAGE: the `PYTHON_IMAGE` the Dockerfiles
#                take instead of python:3.11-slim-bookworm. With Python's headers, as that image
#                has them (python3.11-dev): torch's Inductor compiles C++ against Python.h at run
#                time (vLLM's CPU sampler does; without them: "fatal error: Python.h"). $CA_BUNDLE is baked in as the system
#                CA bundle and /etc/pip.conf points pip at it (pip behind a TLS-intercepting
#                proxy), and at /opt/wheels as find-links (the build mounts $WHEELS there).
#   redis        Debian's redis-server (7.0) the same way, as $REDIS_IMAGE: the image compose
#                takes through REDIS_IMAGE instead of redis:7.4-alpine. It runs as uid/gid 999
#                (the official image's redis user) with /data as its working directory.
#   env reward rollout-cpu learner-cpu
#                docker/*.Dockerfile as shipped, only build arguments set (PYTHON_IMAGE,
#                DEVICE=cpu, TORCH_INDEX_URL, REVISION, CREATED), in Docker format so that
#                the images keep their HEALTHCHECK; tagged as docker-compose.yml names them
#                (sinkflex/env:latest, sinkflex/reward:latest, sinkflex/rollout:cpu,
#                sinkflex/learner:cpu).
# base and redis are skipped when the image exists (--rebuild-base: make them again).
#
# Options:
#   --configure     write /etc/containers/containers.conf (runc, ulimits nofile/nproc 1024/4096)
#                   when it does not exist: podman's defaults (crun, the host's ulimits) fail on
#                   hosts with hybrid cgroups or lower hard limits
#   --timings FILE  append one JSON object per built image: {name, image, built, build_s,
#                   size_mb, started}
#   --dry-run       print what would run (one line per command, shell-quoted), run nothing
#
# Environment (defaults in brackets):
#   ENGINE           podman or docker                             [podman]
#   BASE_IMAGE       the Python base image's name                 [localhost/sinkflex/python:3.11-bookworm]
#   REDIS_IMAGE      the Redis image's name                       [localhost/sinkflex/redis:7-bookworm]
#   DEBIAN_MIRROR    debootstrap's mirror                         [http://deb.debian.org/debian]
#   CA_BUNDLE        CA bundle baked into the base                [/etc/ssl/certs/ca-certificates.crt]
#   WHEELS           folder of local wheels mounted read-only at /opt/wheels during the builds
#                    (the CPU torch wheel); empty: none           [/opt/wheels when it exists]
#   TORCH_INDEX_URL  index of the CPU torch wheel                 [https://pypi.org/simple]
#                    (the Dockerfiles' default, download.pytorch.org/whl/cpu, where reachable)
#   BUILD_ARGS       more `--build-arg K=V` words for every service image
#
# Needs root (debootstrap, chroot), debootstrap, tar and the engine. Everything is built from
# the repository this script lies in.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENGINE=${ENGINE:-podman}
BASE_IMAGE=${BASE_IMAGE:-localhost/sinkflex/python:3.11-bookworm}
REDIS_IMAGE=${REDIS_IMAGE:-localhost/sinkflex/redis:7-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if [ -z "${WHEELS+set}" ]; then
  if [ -d /opt/wheels ]; then WHEELS=/opt/wheels; else WHEELS=; fi
fi
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
BUILD_ARGS=${BUILD_ARGS:-}

CONFIGURE=0
REBUILD_BASE=0
DRY_RUN=0
TIMINGS=
IMAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --configure) CONFIGURE=1 ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --timings) TIMINGS=$2; shift ;;
    --timings=*) TIMINGS=${1#--timings=} ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    base|redis|env|reward|rollout-cpu|learner-cpu) IMAGES+=("$1") ;;
    *) echo "build_images.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(base redis env reward rollout-cpu learner-cpu)

log() { echo "build_images.sh: $*" >&2; }

image_exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

image_size_mb() {
  "$ENGINE" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f", $1 / 1e6}'
}

record() {  # name image seconds started
  local size
  size=$(image_size_mb "$2")
  log "$1: $2 built in $3 s, $size MB"
  if [ -n "$TIMINGS" ]; then
    printf '{"name": "%s", "image": "%s", "built": true, "build_s": %s, "size_mb": %s, "started": "%s"}\n' \
      "$1" "$2" "$3" "$size" "$4" >>"$TIMINGS"
  fi
}

configure() {
  local conf=/etc/containers/containers.conf
  if [ -e "$conf" ]; then
    log "$conf exists; left as it is (it needs runtime = \"runc\" and default_ulimits on hosts like this one)"
    return
  fi
  mkdir -p /etc/containers
  cat >"$conf" <<'EOF'
# Written by SinkFlex-RL's scripts/build_images.sh --configure: crun refuses hybrid cgroups
# ("cgroups in hybrid mode not supported") and podman's default ulimits may exceed the host's
# hard limits ("setrlimit RLIMIT_NOFILE: Operation not permitted").
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
EOF
  log "wrote $conf"
}

# debootstrap a bookworm minbase with PACKAGES into a fresh folder; prints the folder
bootstrap() {
  local packages=$1 dir
  dir=$(mktemp -d /var/tmp/sinkflex-rootfs.XXXXXX)
  log "debootstrap bookworm ($packages) into $dir"
  debootstrap --variant=minbase --include="$packages" bookworm "$dir" "$DEBIAN_MIRROR" >&2
  cp "$CA_BUNDLE" "$dir/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb
  echo "$dir"
}

dry() {  # print a command shell-quoted
  local out=() a
  for a in "$@"; do out+=("$(printf '%q' "$a")"); done
  echo "${out[*]}"
}

build_base() {
  if [ "$DRY_RUN" = 1 ]; then
    dry debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3.11-dev,python3-pip,ca-certificates bookworm ROOTFS "$DEBIAN_MIRROR"
    dry "$ENGINE" import - "$BASE_IMAGE"
    return
  fi
  if image_exists "$BASE_IMAGE" && [ "$REBUILD_BASE" = 0 ]; then
    log "$BASE_IMAGE exists (--rebuild-base to make it again)"; return
  fi
  local started t0 dir
  started=$(date -u +%Y-%m-%dT%H:%M:%SZ); t0=$(date +%s)
  dir=$(bootstrap python3.11,python3.11-venv,python3.11-dev,python3-pip,ca-certificates)
  # pip inside the builds: the CA bundle above, and the wheel folder the builds mount
  cat >"$dir/etc/pip.conf" <<'EOF'
[global]
cert = /etc/ssl/certs/ca-certificates.crt
find-links = /opt/wheels
EOF
  mkdir -p "$dir/opt/wheels"
  ln -sf python3 "$dir/usr/bin/python"
  tar -C "$dir" -c . | "$ENGINE" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$BASE_IMAGE" >/dev/null
  rm -rf "$dir"
  record base "$BASE_IMAGE" $(( $(date +%s) - t0 )) "$started"
}

build_redis() {
  if [ "$DRY_RUN" = 1 ]; then
    dry debootstrap --variant=minbase --include=redis-server bookworm ROOTFS "$DEBIAN_MIRROR"
    dry "$ENGINE" import - "$REDIS_IMAGE"
    return
  fi
  if image_exists "$REDIS_IMAGE" && [ "$REBUILD_BASE" = 0 ]; then
    log "$REDIS_IMAGE exists (--rebuild-base to make it again)"; return
  fi
  local started t0 dir
  started=$(date -u +%Y-%m-%dT%H:%M:%SZ); t0=$(date +%s)
  dir=$(bootstrap redis-server)
  # uid/gid 999 as in the official redis image, so that compose's `user: "999:999"` fits both
  chroot "$dir" groupmod -g 999 redis
  chroot "$dir" usermod -u 999 -g 999 redis
  mkdir -p "$dir/data"
  chown 999:999 "$dir/data"
  chroot "$dir" sh -c 'chown -R 999:999 /var/lib/redis /var/log/redis'
  tar -C "$dir" -c . | "$ENGINE" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'WORKDIR /data' \
    --change 'USER 999:999' \
    --change 'EXPOSE 6379' \
    --change 'CMD ["redis-server"]' \
    - "$REDIS_IMAGE" >/dev/null
  rm -rf "$dir"
  record redis "$REDIS_IMAGE" $(( $(date +%s) - t0 )) "$started"
}

build_service() {  # name dockerfile tag [build-arg ...]
  local name=$1 dockerfile=$2 tag=$3; shift 3
  local started t0 args=()
  started=$(date -u +%Y-%m-%dT%H:%M:%SZ); t0=$(date +%s)
  if [ "$DRY_RUN" = 0 ] && ! image_exists "$BASE_IMAGE"; then
    log "no $BASE_IMAGE: build 'base' first"; exit 1
  fi
  args+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
  args+=(--build-arg "REVISION=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || true)")
  args+=(--build-arg "CREATED=$started")
  for a in "$@"; do args+=(--build-arg "$a"); done
  for a in $BUILD_ARGS; do args+=(--build-arg "$a"); done
  [ -n "$WHEELS" ] && args+=(--volume "$WHEELS:/opt/wheels:ro")
  if [ "$ENGINE" = podman ]; then
    args+=(--format docker)  # OCI format drops HEALTHCHECK
  fi
  if [ "$DRY_RUN" = 1 ]; then
    dry "$ENGINE" build -f "$ROOT/$dockerfile" -t "$tag" "${args[@]}" "$ROOT"
    return
  fi
  log "$ENGINE build -f $dockerfile -t $tag ${args[*]} $ROOT"
  "$ENGINE" build -f "$ROOT/$dockerfile" -t "$tag" "${args[@]}" "$ROOT"
  record "$name" "$tag" $(( $(date +%s) - t0 )) "$started"
}

[ "$CONFIGURE" = 1 ] && configure
for image in "${IMAGES[@]}"; do
  case "$image" in
    base) build_base ;;
    redis) build_redis ;;
    env) build_service env docker/env.Dockerfile sinkflex/env:latest ;;
    reward) build_service reward docker/reward.Dockerfile sinkflex/reward:latest ;;
    rollout-cpu) build_service rollout-cpu docker/rollout.Dockerfile sinkflex/rollout:cpu \
                   DEVICE=cpu "TORCH_INDEX_URL=$TORCH_INDEX_URL" ;;
    learner-cpu) build_service learner-cpu docker/learner.Dockerfile sinkflex/learner:cpu \
                   DEVICE=cpu "TORCH_INDEX_URL=$TORCH_INDEX_URL" ;;
  esac
done
