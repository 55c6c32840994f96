#!/usr/bin/env bash
# Copies Abseil's headers, libraries and CMake config into .device-carry/absl,
# so the backend and its tests configure on the GPU machine, which has CUDA,
# CMake and GoogleTest but no Abseil. Name .device-carry in the device tool's
# `carry` and configure there with -DCMAKE_PREFIX_PATH=$PWD/.device-carry/absl.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device-carry/absl
rm -rf "$dest"
mkdir -p "$dest/include" "$dest/lib/x86_64-linux-gnu/cmake"
cp -a /usr/include/absl "$dest/include/"
cp -a /usr/lib/x86_64-linux-gnu/libabsl_* "$dest/lib/x86_64-linux-gnu/"
cp -a /usr/lib/x86_64-linux-gnu/cmake/absl "$dest/lib/x86_64-linux-gnu/cmake/"
du -sh "$dest"
