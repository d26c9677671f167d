#!/usr/bin/env bash
# Make a local base image for a machine without an image registry: a minimal Debian bookworm
# (debootstrap) with python3, python3-venv and pip, imported into the Docker engine as NAME.
#   deploy/compose/base.sh [NAME]        (default mcpb-base:bookworm; root, debootstrap, docker)
# The host's CA bundle goes into the image, so pip and apt inside builds on the host network trust
# what the host trusts. MCPB_BASE_CACHE=FILE keeps the root file system as a tar there and
# imports that on the next run instead of bootstrapping again (about a minute saved).
set -euo pipefail
name=${1:-mcpb-base:bookworm}
mirror=${MCPB_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${MCPB_BASE_CACHE:-}

if [ -n "$cache" ] && [ -s "$cache" ]; then
  echo "base: importing $cache as $name"
  timeout 300 docker import - "$name" < "$cache" >/dev/null
  exit 0
fi

for tool in debootstrap docker; do
  command -v "$tool" >/dev/null 2>&1 || { echo "base: $tool is missing (apt-get install debootstrap docker.io)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "base: debootstrap needs root" >&2; exit 1; }

work=$(mktemp -d /tmp/mcpb-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
echo "base: debootstrap bookworm from $mirror (about a minute)"
if ! timeout 600 debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1; then
  tail -n 30 "$work/debootstrap.log" >&2
  echo "base: debootstrap failed" >&2
  exit 1
fi
# Updates and security fixes for what the derived images install (deploy/compose/*.Dockerfile).
security=${mirror%/debian}/debian-security
cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
# What an image does not need: package lists and caches, documentation, translations, logs.
rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* \
  "$rootfs"/var/log/*.log "$rootfs"/tmp/* "$rootfs"/root/.cache
if [ -n "$cache" ]; then
  mkdir -p "$(dirname "$cache")"
  tar -C "$rootfs" -c . > "$cache.part" && mv "$cache.part" "$cache"
  timeout 300 docker import - "$name" < "$cache" >/dev/null
else
  tar -C "$rootfs" -c . | timeout 300 docker import - "$name" >/dev/null
fi
echo "base: imported $name ($(docker image inspect -f '{{.Size}}' "$name" | awk '{printf "%.0f MB", $1/1e6}'))"
