#!/usr/bin/env bash
# Runs in the build stage of deploy/Dockerfile and deploy/Dockerfile.cpu:
# configures and builds attnserve and attnctl (Release, no tests or benches)
# and lays out what the runtime stage copies, under OUT_DIR:
#   OUT_DIR/usr/local/bin/{attnserve,attnctl}
#   OUT_DIR/usr/local/lib/attnserve/*.so*    shared libraries the binaries need
#                                            beyond glibc (none when the static
#                                            link works)
#   OUT_DIR/etc/ld.so.conf.d/attnserve.conf  so the loader finds them
# Copying the libraries the binaries actually load (from ldd) instead of
# installing runtime packages keeps one recipe for Debian and Ubuntu, whose
# package names differ (libgrpc++1.51 vs libgrpc++1.51t64, ...).
#
# Environment: ATTNSERVE_CUDA (AUTO|ON|OFF), ATTNSERVE_STATIC (AUTO|ON|OFF;
# AUTO tries the static link and falls back to shared libraries if it fails),
# CUDA_ARCHS (CMAKE_CUDA_ARCHITECTURES, empty: the project default),
# JOBS (parallel compile jobs, empty: nproc), EXTRA_CMAKE_ARGS.
set -euo pipefail

out=${1:?usage: deploy/build-in-image.sh OUT_DIR}
src=$(cd "$(dirname "$0")/.." && pwd)
build=$src/build-image
jobs=${JOBS:-$(nproc)}

cmake_args=(
  -G Ninja
  -DCMAKE_BUILD_TYPE=Release
  -DATTNSERVE_BUILD_TESTS=OFF
  -DATTNSERVE_BUILD_BENCH=OFF
  -DATTNSERVE_CUDA="${ATTNSERVE_CUDA:-AUTO}"
)
[ -z "${CUDA_ARCHS:-}" ] || cmake_args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
# shellcheck disable=SC2206  # EXTRA_CMAKE_ARGS is a list of words on purpose
[ -z "${EXTRA_CMAKE_ARGS:-}" ] || cmake_args+=($EXTRA_CMAKE_ARGS)

build_with() {  # build_with ON|OFF: configure and build with that static setting
  cmake -S "$src" -B "$build" "${cmake_args[@]}" -DATTNSERVE_STATIC="$1"
  cmake --build "$build" -j "$jobs" --target attnserve attnctl
}
start=$(date +%s)
static=${ATTNSERVE_STATIC:-AUTO}
case "$static" in
  ON|OFF) build_with "$static" ;;
  AUTO)
    # Only the link step differs, so the fallback costs seconds, not a rebuild.
    if ! build_with ON; then
      echo "build-in-image: WARNING: the static link failed; building with" \
           "ATTNSERVE_STATIC=OFF and bundling the shared libraries instead" >&2
      build_with OFF
    fi ;;
  *) echo "build-in-image: ATTNSERVE_STATIC must be AUTO, ON or OFF, got '$static'" >&2; exit 2 ;;
esac
echo "build-in-image: compiled in $(( $(date +%s) - start )) s with $jobs jobs"

install -d "$out/usr/local/bin" "$out/usr/local/lib/attnserve" "$out/etc/ld.so.conf.d"
install -m 0755 -s "$build/server/attnserve" "$build/client/attnctl" "$out/usr/local/bin/"

# Everything ldd resolves except glibc's own libraries (present in every base
# image, and they must match its loader) and the NVIDIA driver's, which the
# container toolkit mounts at run time (--gpus / nvidia.com/gpu).
# A static binary has no dependencies to copy (ldd says "not a dynamic
# executable" and fails).
for bin in "$out"/usr/local/bin/*; do
  ldd "$bin" 2>/dev/null | awk '/=> \// {print $3}' || true
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;
    libcuda.so*|libnvidia*) ;;
    *) cp -L "$lib" "$out/usr/local/lib/attnserve/" ;;
  esac
done
echo /usr/local/lib/attnserve >"$out/etc/ld.so.conf.d/attnserve.conf"

echo "build-in-image: binaries:"
for bin in "$out"/usr/local/bin/*; do
  echo "  $(basename "$bin"): $(stat -c %s "$bin") bytes, $(file -b "$bin" 2>/dev/null | cut -d, -f1-2 || true)"
done
echo "build-in-image: bundled shared libraries (none when static):"
find "$out/usr/local/lib/attnserve" -type f -printf '  %f\n'
# A binary that links the CUDA driver library directly would not start without
# a GPU; the CPU fallback of --backend=auto needs libcuda to be loaded lazily.
if { ldd "$out/usr/local/bin/attnserve" 2>/dev/null || true; } | grep -q 'libcuda\.so'; then
  echo "build-in-image: WARNING: attnserve links libcuda.so directly; it will not start on a host without the NVIDIA driver" >&2
fi
