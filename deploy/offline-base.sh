#!/usr/bin/env bash
# A base image from Debian packages alone, for builds that reach no image registry (air-gapped): a minimal
# Debian bookworm root filesystem (debootstrap) imported into Podman or Docker.
#
#   deploy/offline-base.sh python   # localhost/triage-base:bookworm-python: BASE_IMAGE of the worker image
#   deploy/offline-base.sh java     # localhost/triage-base:bookworm-java: BASE_IMAGE of deploy/kafka/Dockerfile
#   deploy/offline-base.sh python my-registry/base:1   # another tag
#
# Needs root and debootstrap; installs neither. Mirror: $DEBIAN_MIRROR, else the Debian mirror in this machine's
# apt sources, else http://deb.debian.org/debian. Engine: $CONTAINER_ENGINE, else podman or docker, whichever
# answers. Downloaded packages are kept in ~/.cache/triage-worker/debootstrap/<kind> for the next run (one
# folder per kind, so that both kinds can be built at once).
set -euo pipefail

kind=${1:-python}
case "$kind" in
    python) packages=python3,python3-venv,python-is-python3,ca-certificates ;;
    java) packages=openjdk-17-jre-headless,ca-certificates ;;
    *) echo "usage: $0 python|java [TAG]" >&2; exit 2 ;;
esac
tag=${2:-localhost/triage-base:bookworm-$kind}

fail() { echo "offline-base: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "debootstrap needs root: run it with sudo"
command -v debootstrap >/dev/null || fail "debootstrap is not installed (Debian/Ubuntu: apt-get install debootstrap)"

engine=${CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
    for candidate in podman docker; do
        if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then
            engine=$candidate
            break
        fi
    done
fi
[ -n "$engine" ] || fail "no container engine answers: install Podman or Docker, or set CONTAINER_ENGINE"

mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
    # The first plain Debian archive in the apt sources (one-line or deb822 format), not security or a third party.
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -v -E '^\s*#' | grep -o -E 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)
    mirror=${mirror:-http://deb.debian.org/debian}
fi

cache=${XDG_CACHE_HOME:-$HOME/.cache}/triage-worker/debootstrap/$kind
rootfs=$(mktemp -d /tmp/triage-base-XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
mkdir -p "$cache"

started=$SECONDS
echo "offline-base: debootstrap bookworm ($packages) from $mirror"
if ! debootstrap --variant=minbase --include="$packages" --cache-dir="$cache" bookworm "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1; then
    tail -n 20 "$rootfs.log" >&2
    fail "debootstrap failed (full log: $rootfs.log)"
fi
rm -f "$rootfs.log"
# Package lists and downloaded archives are of no use in an image.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
echo "offline-base: importing $(du -sh "$rootfs" | cut -f1) into $engine as $tag"
quiet=()
[ "$engine" = podman ] && quiet=(--quiet)  # its progress lines say nothing here
tar -C "$rootfs" -c . | "$engine" import "${quiet[@]}" - "$tag" >/dev/null
echo "offline-base: $tag ready in $((SECONDS - started))s"
