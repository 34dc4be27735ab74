#!/usr/bin/env bash
# Real container engines for the test suite: a Docker engine (and Podman) with a locally built image.
#
#   engine_env=$(.ci/container_engine.sh start) && eval "$engine_env"   # prints `export NAME=VALUE` lines
#   .ci/container_engine.sh stop                                       # stops the engine, removes its state
#
# No registry is reachable on the CI machines, so the image is made here: a minimal Debian root (debootstrap
# from the Debian mirror apt already uses), imported as local/minbase:1. Its tarball is cached under
# /var/cache/batch_runner-ci where the machine keeps that directory, so only a fresh machine pays the
# debootstrap (about 45 s). The engines keep all their state under one scratch directory and listen on a
# socket there, never on the system's default: nothing of a system engine is touched, and `stop` leaves
# no process or mount behind (only what the programs always make: /run/docker, and Podman's small
# /var/lib/containers/cache). `start` on an engine already running from an earlier `start` reuses it.
#
# BATCH_RUNNER_CI_ENGINES names the engines to set up ("docker podman" unless set); `start` fails, saying
# why, when one of them cannot run. Exported for the tests: DOCKER_HOST, BATCH_RUNNER_TEST_IMAGE,
# BATCH_RUNNER_TEST_ENGINES (the engines set up), CONTAINERS_CONF and CONTAINERS_STORAGE_CONF (Podman's).
set -euo pipefail

SCRATCH=${BATCH_RUNNER_CI_SCRATCH:-/tmp/batch_runner-ci}
CACHE=${BATCH_RUNNER_CI_CACHE:-/var/cache/batch_runner-ci}
ENGINES=${BATCH_RUNNER_CI_ENGINES:-docker podman}
IMAGE=local/minbase:1
SUITE=bookworm
ROOTFS_TAR=$CACHE/minbase-$SUITE.tar
DOCKER_SOCK=$SCRATCH/docker.sock
DOCKER_PID=$SCRATCH/docker.pid
PODMAN_DIR=$SCRATCH/podman
# Seconds dockerd may take to answer; it is ready in about one here.
READY_SECONDS=30

log() { echo "container_engine: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

docker_cli() { DOCKER_HOST="unix://$DOCKER_SOCK" docker "$@"; }
podman_cli() { CONTAINERS_CONF=$PODMAN_DIR/containers.conf CONTAINERS_STORAGE_CONF=$PODMAN_DIR/storage.conf podman "$@"; }

wanted() { [[ " $ENGINES " == *" $1 "* ]]; }

install_packages() {
    local missing=()
    if wanted docker; then
        command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    fi
    command -v debootstrap >/dev/null 2>&1 || [ -s "$ROOTFS_TAR" ] || missing+=(debootstrap)
    if wanted podman; then
        command -v podman >/dev/null 2>&1 || missing+=(podman)
        command -v runc >/dev/null 2>&1 || missing+=(runc)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# The Debian mirror the machine's apt sources name for $SUITE (deb822 or one-line format).
debian_mirror() {
    local mirror
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk -v suite="$SUITE" '
            /^URIs:/    { uris = $2 }
            /^Suites:/  { for (i = 2; i <= NF; i++) if ($i == suite) { print uris; exit } }
            /^deb[ \t]/ { line = $0; sub(/\[[^]]*\]/, "", line); split(line, word, /[ \t]+/)
                          if (word[3] == suite) { print word[2]; exit } }')
    echo "${mirror:-http://deb.debian.org/debian}"
}

# The cached root file system tarball, made once per machine.
ensure_rootfs() {
    [ -s "$ROOTFS_TAR" ] && return
    local mirror rootfs=$SCRATCH/rootfs
    mirror=$(debian_mirror)
    log "building a $SUITE minbase root from $mirror (cached in $ROOTFS_TAR)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >"$SCRATCH/debootstrap.log" 2>&1 ||
        { tail -20 "$SCRATCH/debootstrap.log" >&2; die "debootstrap from $mirror"; }
    mkdir -p "$CACHE"
    tar -C "$rootfs" -cf "$ROOTFS_TAR.partial" . && mv "$ROOTFS_TAR.partial" "$ROOTFS_TAR"
    rm -rf "$rootfs"
}

docker_alive() { [ -s "$DOCKER_PID" ] && kill -0 "$(cat "$DOCKER_PID")" 2>/dev/null; }

# Start dockerd with one storage driver; true once it answers.
start_dockerd() {
    local driver=$1
    # A dockerd killed with -9 left its pidfile, which the next one refuses to start over.
    docker_alive || rm -f "$DOCKER_PID"
    dockerd --data-root "$SCRATCH/docker-data" --exec-root "$SCRATCH/docker-exec" --pidfile "$DOCKER_PID" \
        -H "unix://$DOCKER_SOCK" --storage-driver="$driver" --iptables=false --ip6tables=false --bridge=none \
        --ip-forward=false \
        >"$SCRATCH/dockerd-$driver.log" 2>&1 &
    local started=$SECONDS
    while [ $((SECONDS - started)) -lt $READY_SECONDS ]; do
        docker_cli version --format '{{.Server.Version}}' >/dev/null 2>&1 && return 0
        kill -0 $! 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

ensure_docker() {
    if docker_alive && docker_cli version >/dev/null 2>&1; then
        log "reusing dockerd $(cat "$DOCKER_PID")"
    elif ! start_dockerd overlay2; then
        log "dockerd with overlay2 did not start ($(tail -1 "$SCRATCH/dockerd-overlay2.log")); trying vfs"
        stop_docker
        start_dockerd vfs || { tail -20 "$SCRATCH/dockerd-vfs.log" >&2; die "dockerd did not start"; }
    fi
    docker_cli image inspect "$IMAGE" >/dev/null 2>&1 || docker_cli import "$ROOTFS_TAR" "$IMAGE" >/dev/null ||
        die "docker import of $ROOTFS_TAR"
}

# Rootful Podman with its storage under the scratch directory. runc: crun 1.8 refuses this machine's
# control groups; cgroupfs and file events: there is no systemd; explicit ulimits: the container's
# defaults would need CAP_SYS_RESOURCE, which the CI machines' root lacks; no network by default, as
# dockerd above: a container on Podman's bridge would add a host interface and firewall rules.
ensure_podman() {
    mkdir -p "$PODMAN_DIR"
    cat >"$PODMAN_DIR/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
netns = "none"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$PODMAN_DIR/events.log"
tmp_dir = "$PODMAN_DIR/tmp"
[network]
network_config_dir = "$PODMAN_DIR/networks"
EOF
    cat >"$PODMAN_DIR/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$PODMAN_DIR/storage"
runroot = "$PODMAN_DIR/run"
EOF
    podman_cli image exists "$IMAGE" || podman_cli import -q "$ROOTFS_TAR" "$IMAGE" >/dev/null ||
        die "podman import of $ROOTFS_TAR"
    podman_cli run --rm "$IMAGE" true >/dev/null 2>"$PODMAN_DIR/check.log" ||
        { cat "$PODMAN_DIR/check.log" >&2; die "podman cannot run a container"; }
}

stop_docker() {
    if docker_alive; then
        local pid
        pid=$(cat "$DOCKER_PID")
        # Containers first: dockerd leaves running ones (and their mounts) behind when it stops.
        docker_cli ps -aq | xargs -r env DOCKER_HOST="unix://$DOCKER_SOCK" docker rm -f >/dev/null 2>&1 || true
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$DOCKER_PID"
}

stop_podman() {
    [ -f "$PODMAN_DIR/containers.conf" ] || return 0
    podman_cli rm -af -t 0 >/dev/null 2>&1 || true
}

# Whatever the engines mounted under the scratch directory, deepest first.
unmount_scratch() {
    awk -v root="$SCRATCH" '$2 == root || index($2, root "/") == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r mount_point; do umount -l "$mount_point" 2>/dev/null || true; done
}

start() {
    mkdir -p "$SCRATCH"
    install_packages
    ensure_rootfs
    if wanted docker; then
        ensure_docker
        echo "export DOCKER_HOST=unix://$DOCKER_SOCK"
    fi
    if wanted podman; then
        ensure_podman
    fi
    echo "export BATCH_RUNNER_TEST_IMAGE=$IMAGE"
    echo "export BATCH_RUNNER_TEST_ENGINES='$ENGINES'"
    echo "export CONTAINERS_CONF=$PODMAN_DIR/containers.conf"
    echo "export CONTAINERS_STORAGE_CONF=$PODMAN_DIR/storage.conf"
    log "ready: $ENGINES with $IMAGE"
}

stop() {
    [ -d "$SCRATCH" ] || return 0
    stop_podman
    stop_docker
    unmount_scratch
    rm -rf "$SCRATCH"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
