#!/usr/bin/env bash
# Makes a local Debian 12 base image (localhost/debian:bookworm by default)
# with debootstrap, because no container registry is reachable here
# (docs/containers.md). The CPU image and the GPU image's
# build stage are then built FROM it with --build-arg BASE=... .
# Skips the work when the image already exists (--force rebuilds it).
#
# Needs root (debootstrap), podman and debootstrap; scripts/container-smoke.sh
# installs them and sets CONTAINERS_CONF before calling this.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/make-base-image.sh [--image NAME] [--suite SUITE] [--mirror URL] [--force]

  --image NAME   image to create (default: localhost/debian:bookworm)
  --suite SUITE  Debian suite for debootstrap (default: bookworm)
  --mirror URL   Debian mirror (default: the first deb.debian.org-style URI that
                 apt uses, read from /etc/apt/sources.list{,.d/*})
  --force        rebuild even if the image exists
EOF
}

image=localhost/debian:bookworm
suite=bookworm
mirror=""
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --image) image=$2; shift 2 ;;
    --image=*) image=${1#*=}; shift ;;
    --suite) suite=$2; shift 2 ;;
    --suite=*) suite=${1#*=}; shift ;;
    --mirror) mirror=$2; shift 2 ;;
    --mirror=*) mirror=${1#*=}; shift ;;
    --force) force=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "make-base-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "make-base-image: $*" >&2; exit 1; }
command -v podman >/dev/null || die "podman is not installed (apt-get install -y podman)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
[ "$(id -u)" -eq 0 ] || die "debootstrap needs root"

if [ "$force" -eq 0 ] && podman image exists "$image"; then
  echo "make-base-image: $image exists, skipping (--force rebuilds it)"
  exit 0
fi

# The mirror apt already uses is the one that is reachable; a security or
# updates URI would not carry the main suite, so skip those.
find_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    case "$f" in
      *.sources) grep -E '^URIs:' "$f" | awk '{for (i = 2; i <= NF; i++) print $i}' ;;
      *) grep -E '^deb ' "$f" | sed -E 's/^deb (\[[^]]*\] )?//' | awk '{print $1}' ;;
    esac
  done | grep -v -E 'security|updates|backports' | grep -E '^https?://' | head -n 1
}
[ -n "$mirror" ] || mirror=$(find_mirror)
[ -n "$mirror" ] || die "found no Debian mirror in /etc/apt/sources.list*; pass --mirror URL"

rootfs=$(mktemp -d /var/tmp/attnserve-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
start=$(date +%s)
echo "make-base-image: debootstrap --variant=minbase $suite from $mirror"
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed"; }
rm -f "$rootfs.log"
# Inside the image apt must use the same reachable mirror (debootstrap writes
# only the main suite; add updates and security like a stock image has, but
# from the same host so the build does not depend on anything else).
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
EOF
# Slim the image as debian:*-slim does: no apt lists or caches in the layer.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | podman import \
  --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$image" >/dev/null
echo "make-base-image: $image ready in $(( $(date +%s) - start )) s"
