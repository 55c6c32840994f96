#!/usr/bin/env bash
# Builds the CPU server, client and every test with sanitizers in a build
# directory of their own and runs the whole ctest under them.
# Usage: scripts/sanitize.sh [address,undefined|thread] [BUILD_DIR] [all|request-path]
#   address,undefined (default): ASan + UBSan over everything; any report fails.
#     request-path (CI's choice: the whole set takes about 40 minutes to build
#     on the 2-core machine): only the tests of what a request goes through,
#     validation, the CPU backend, the server's handlers over the wire, the K/V
#     pool and the KServe conversion and shared memory; each binary is run
#     directly (every test in it).
#   thread: TSan, built and run only for the tests of the project's own
#     concurrent parts (executor, batching, stream handling); see
#     tests/tsan.supp for what is suppressed and why.
# Needs what scripts/install-deps.sh installs; CUDA is off (nothing to run it).
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=${1:-address,undefined}
build_dir=${2:-$([[ $sanitizers == address,undefined ]] && echo build-asan || echo build-tsan)}
subset=${3:-all}
jobs=$(nproc)
repo=$(pwd)

if [[ $sanitizers == address,undefined ]]; then
  # clang, shared with scripts/fuzz.sh (one compile of the project for both).
  source scripts/lib-sanitized-build.sh
  configure_sanitized_build "$build_dir"
else
  source scripts/lib-sanitized-build.sh  # for its build flags
  cmake -S . -B "$build_dir" -G Ninja "${sanitized_build_flags[@]}" \
    -DCMAKE_CXX_COMPILER=clang++ -DATTNSERVE_CUDA=OFF -DATTNSERVE_BUILD_BENCH=OFF \
    -DATTNSERVE_SANITIZE="$sanitizers" \
    ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER}
fi
start=$(date +%s)
if [[ $sanitizers == thread ]]; then
  # The concurrent parts whose synchronisation TSan can see (see the usage
  # note above and tests/tsan.supp).
  tsan_tests=(cpu_backend_test executor_test executor_pipeline_test batching_test)
  cmake --build "$build_dir" -j "$jobs" --target "${tsan_tests[@]}"
  pattern='^(CpuBackend|Grid/CpuBackend|ExecutorTest|ExecutorPipelineTest|DynamicBatchingTest|PackedBatchTest)'
elif [[ $subset == request-path ]]; then
  request_path_tests=(tests/server/request_validation_test tests/backend/cpu_backend_test
    tests/server/server_integration_test tests/server/kv_pool_test tests/kserve/kserve_grpc_test
    tests/kserve/kserve_shm_registry_test)
  cmake --build "$build_dir" -j "$jobs" --target "${request_path_tests[@]##*/}"
else
  cmake --build "$build_dir" -j "$jobs"
  pattern=.
fi
echo "sanitize.sh: build took $(( $(date +%s) - start )) s on $jobs cores"

# halt_on_error: the first report fails the test. detect_leaks: LeakSanitizer
# is part of ASan; every leak is a finding. The suppression files name each
# library frame they hide and why.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0
export LSAN_OPTIONS=suppressions=$repo/tests/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$repo/tests/tsan.supp
start=$(date +%s)
if [[ $sanitizers == address,undefined && $subset == request-path ]]; then
  status=0
  for t in "${request_path_tests[@]}"; do
    log="$build_dir/sanitize-${t##*/}.log"
    if "$build_dir/$t" >"$log" 2>&1; then
      echo "sanitize.sh: ${t##*/}: $(grep -E '^\[  PASSED  \]' "$log" || echo passed)"
    else
      echo "sanitize.sh: ${t##*/} FAILED; last lines of $log:"
      tail -40 "$log"
      status=1
    fi
  done
  echo "sanitize.sh: tests took $(( $(date +%s) - start )) s"
  exit $status
fi
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -R "$pattern"
echo "sanitize.sh: ctest took $(( $(date +%s) - start )) s"
