#!/usr/bin/env bash
# Builds a local base image for the Cumulus images without pulling anything: a minimal
# Debian bookworm root filesystem made by debootstrap from Debian's package mirror, with
# the runtime packages the images need (python3 for `python train.py` jobs, tini, curl,
# CA certificates, prometheus for the `prometheus` service), then `docker import`ed.
#
# usage: compose/base-image.sh [IMAGE]      (default IMAGE: cumulus-base:bookworm)
#
# Environment:
#   CUMULUS_DEBIAN_MIRROR   mirror URL (default: the first one in /etc/apt/sources*)
#   CUMULUS_COMPOSE_CACHE   where the root filesystem tarball is cached
#                           (default: compose/.cache); delete it to rebuild
# Does nothing when IMAGE already exists with this package list (its label
# cumulus.packages). Needs root (debootstrap) and debootstrap.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
image="${1:-cumulus-base:bookworm}"
cache="${CUMULUS_COMPOSE_CACHE:-$here/.cache}"
packages="python3,python-is-python3,tini,curl,ca-certificates,prometheus"

# An image (or a cached root filesystem) made with another package list is made again.
if [ "$(docker image inspect -f '{{index .Config.Labels "cumulus.packages"}}' "$image" 2>/dev/null)" = "$packages" ]; then
  echo "base image $image exists"
  exit 0
fi

tarball="$cache/rootfs-bookworm-$(printf '%s' "$packages" | cksum | cut -d' ' -f1).tar"
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || {
    echo "debootstrap is missing: apt-get install debootstrap" >&2
    exit 1
  }
  mirror="${CUMULUS_DEBIAN_MIRROR:-}"
  if [ -z "$mirror" ]; then
    mirror="$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
      | grep -oE 'https?://[^ ]+' | head -n1 || true)"
  fi
  mirror="${mirror:-http://deb.debian.org/debian}"
  mkdir -p "$cache"
  root="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$root"' EXIT
  echo "debootstrap bookworm from $mirror (packages: $packages)"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" \
    >"$cache/debootstrap.log" 2>&1 || {
    tail -n 30 "$cache/debootstrap.log" >&2
    exit 1
  }
  # What a container never needs: package lists and caches, docs, man pages, locales.
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/tmp/*
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' --change "LABEL cumulus.packages=$packages" \
  "$tarball" "$image" >/dev/null
echo "base image $image imported from $tarball"
