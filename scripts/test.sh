#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything
# (the CUDA backend too when nvcc is present), and runs every test with ctest.
# GPU tests report "skipped" on a machine without a GPU.
# Usage: scripts/test.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
scripts/install-deps.sh
# The Python clients' tests run from .venv (tests/python) and .venv-triton (tests/kserve).
scripts/python-env.sh python >/dev/null
scripts/python-env.sh triton >/dev/null
jobs=$(nproc)
# UCX is required here (cmake/ucx.cmake's AUTO would leave the UCX tests out
# silently when libucx-dev is missing; ON stops at configure with the package).
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTNSERVE_UCX=ON
start=$(date +%s)
cmake --build "$build_dir" -j "$jobs"
echo "test.sh: build took $(( $(date +%s) - start )) s on $jobs cores"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 600
