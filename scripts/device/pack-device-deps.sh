#!/usr/bin/env bash
# Prepares .device-carry, the ignored folder the device tool carries to the
# GPU machine (CUDA, CMake and GoogleTest there; no gRPC, protobuf or Abseil):
#  - .device-carry/absl: Abseil's headers, libraries and CMake config, so the
#    backend and its tests configure there (-DCMAKE_PREFIX_PATH=$PWD/.device-carry/absl).
#  - with --server BUILD_DIR: that build's attnserve and attnctl in
#    .device-carry/bin and, for a shared-library build, every library they
#    load that is not part of glibc or the compiler runtime in
#    .device-carry/lib (scripts/gpu-*.sh put it on LD_LIBRARY_PATH). A shared
#    build keeps /metrics, which needs Debian's shared-only cpp-httplib.
# Usage: scripts/device/pack-device-deps.sh [--server BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.device-carry/absl
rm -rf "$dest"
mkdir -p "$dest/include" "$dest/lib/x86_64-linux-gnu/cmake"
cp -a /usr/include/absl "$dest/include/"
cp -a /usr/lib/x86_64-linux-gnu/libabsl_* "$dest/lib/x86_64-linux-gnu/"
cp -a /usr/lib/x86_64-linux-gnu/cmake/absl "$dest/lib/x86_64-linux-gnu/cmake/"
du -sh "$dest"

if [ "${1:-}" = --server ]; then
  build=${2:?usage: scripts/device/pack-device-deps.sh --server BUILD_DIR}
  rm -rf .device-carry/bin .device-carry/lib
  mkdir -p .device-carry/bin .device-carry/lib
  for b in "$build/server/attnserve" "$build/client/attnctl"; do
    strip -o ".device-carry/bin/$(basename "$b")" "$b"
  done
  # glibc, the dynamic loader and the GCC runtime come from the GPU machine
  # (newer there, and backward compatible); everything else travels.
  ldd .device-carry/bin/attnserve .device-carry/bin/attnctl | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libdl|librt|libpthread|libresolv|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so' |
    while read -r lib; do cp -L "$lib" .device-carry/lib/; done
  strip --strip-unneeded .device-carry/lib/*.so* 2>/dev/null || true
  du -sh .device-carry/bin .device-carry/lib
fi
