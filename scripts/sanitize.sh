#!/usr/bin/env bash
# Builds the CPU server, client and tests with sanitizers in a build
# directory of their own and runs a set of tests under them.
# Usage: scripts/sanitize.sh [address,undefined|thread] [BUILD_DIR] [SUBSET]
#   address,undefined (default): ASan + UBSan (+ LeakSanitizer); any report
#     fails. BUILD_DIR defaults to build-asan, the clang build scripts/fuzz.sh
#     uses too (same flags: one compile of the project for both). SUBSET:
#     all (default): every test, through ctest (about 40 minutes to build on
#       the 2-core machine);
#     request-path (CI's): the tests of what a request goes through (see
#       request_path_tests below and docs/sanitizers.md).
#   thread: TSan. BUILD_DIR defaults to build-tsan. Debian's Abseil is made
#     visible to TSan by tests/tsan/absl_sync_annotations.cc (linked into every
#     binary of a TSan build, cmake/sanitizers.cmake). SUBSET:
#     tsan (default; CI's): the annotations' own check and the CPU backend's
#       thread pool (std::mutex, seen by TSan directly);
#     concurrent: tsan plus the executor, batcher, K/V pool and ForwardStream
#       tests (gRPC's own threads are not instrumented; docs/sanitizers.md).
# Each binary of a subset is run directly (every test in it); its log is
# BUILD_DIR/sanitize-NAME.log. Needs what scripts/install-deps.sh installs;
# CUDA is off (nothing to run it).
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=${1:-address,undefined}
if [[ $sanitizers == address,undefined ]]; then
  build_dir=${2:-build-asan}
  subset=${3:-all}
else
  build_dir=${2:-build-tsan}
  subset=${3:-tsan}
fi
jobs=$(nproc)
repo=$(pwd)

source scripts/lib-sanitized-build.sh
if [[ $sanitizers == address,undefined ]]; then
  configure_sanitized_build "$build_dir"
else
  cmake -S . -B "$build_dir" -G Ninja "${sanitized_build_flags[@]}" \
    -DCMAKE_CXX_COMPILER=clang++ -DATTNSERVE_CUDA=OFF -DATTNSERVE_BUILD_BENCH=OFF \
    -DATTNSERVE_SANITIZE="$sanitizers" \
    ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER}
fi

# Test binaries (paths in the build directory) of each subset.
case "$sanitizers/$subset" in
  address,undefined/request-path)
    tests=(tests/server/request_validation_test tests/backend/cpu_backend_test
      tests/server/server_integration_test tests/server/executor_test tests/server/batching_test
      tests/server/kv_pool_test tests/kserve/kserve_grpc_test tests/kserve/kserve_shm_registry_test
      tests/kserve/kserve_shm_test tests/client/client_unit_test) ;;
  thread/tsan)
    tests=(tests/tsan/absl_sync_annotations_test tests/backend/cpu_backend_test
      tests/backend/paged_test) ;;
  thread/concurrent)
    tests=(tests/tsan/absl_sync_annotations_test tests/backend/cpu_backend_test
      tests/backend/paged_test tests/server/executor_test tests/server/executor_pipeline_test
      tests/server/batching_test tests/server/kv_pool_test tests/server/server_integration_test) ;;
  address,undefined/all) tests=() ;;
  *) echo "sanitize.sh: unknown subset '$subset' for $sanitizers" >&2; exit 2 ;;
esac

start=$(date +%s)
if (( ${#tests[@]} )); then
  cmake --build "$build_dir" -j "$jobs" --target "${tests[@]##*/}"
else
  cmake --build "$build_dir" -j "$jobs"
fi
echo "sanitize.sh: build took $(( $(date +%s) - start )) s on $jobs cores"

# halt_on_error: the first report fails the test. detect_leaks: LeakSanitizer
# is part of ASan; every leak is a finding. The suppression files name each
# library frame they hide and why. allocator_may_return_null: the tests of
# allocation failure (K/V memory of 2^62 bytes, paged_test) expect what glibc
# does, a null pointer that the code turns into RESOURCE_EXHAUSTED; the
# sanitizers' allocators abort on such a request unless told to return null.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0:allocator_may_return_null=1
export LSAN_OPTIONS=suppressions=$repo/tests/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$repo/tests/tsan.supp
start=$(date +%s)
if (( ${#tests[@]} == 0 )); then
  ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900
  echo "sanitize.sh: ctest took $(( $(date +%s) - start )) s"
  exit 0
fi
status=0
for t in "${tests[@]}"; do
  log="$build_dir/sanitize-${t##*/}.log"
  t_start=$(date +%s)
  if "$build_dir/$t" >"$log" 2>&1; then
    echo "sanitize.sh: ${t##*/}: $(grep -E '^\[  PASSED  \]' "$log" || echo passed)" \
      "($(( $(date +%s) - t_start )) s)"
  else
    echo "sanitize.sh: ${t##*/} FAILED; last lines of $log:"
    tail -40 "$log"
    status=1
  fi
done
echo "sanitize.sh: tests took $(( $(date +%s) - start )) s"
exit $status
