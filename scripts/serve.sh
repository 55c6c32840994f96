#!/usr/bin/env bash
# The README's serving command: installs what is missing, builds attnserve and
# starts it in the foreground on the best backend present (CUDA with a GPU,
# else CPU). Extra arguments go to attnserve, e.g. scripts/serve.sh --port=50052
# Stop it with Ctrl-C (SIGINT): in-flight requests finish, then it exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${ATTNSERVE_BUILD_DIR:-build}
scripts/install-deps.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$(nproc)" --target attnserve attnctl
exec "$build_dir/server/attnserve" --backend=auto "$@"
