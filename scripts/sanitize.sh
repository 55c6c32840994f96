#!/usr/bin/env bash
# Builds the CPU server, client and every test with sanitizers in a build
# directory of their own and runs the whole ctest under them.
# Usage: scripts/sanitize.sh [address,undefined|thread] [BUILD_DIR]
#   address,undefined (default): ASan + UBSan over everything; any report fails.
#   thread: TSan, built and run only for the tests of the project's own
#     concurrent parts (executor, batching, stream handling); see
#     tests/tsan.supp for what is suppressed and why.
# Needs what scripts/install-deps.sh installs; CUDA is off (nothing to run it).
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=${1:-address,undefined}
build_dir=${2:-$([[ $sanitizers == address,undefined ]] && echo build-asan || echo build-tsan)}
jobs=$(nproc)
repo=$(pwd)

if [[ $sanitizers == address,undefined ]]; then
  # clang, shared with scripts/fuzz.sh (one compile of the project for both).
  source scripts/lib-sanitized-build.sh
  configure_sanitized_build "$build_dir"
else
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
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
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -R "$pattern"
echo "sanitize.sh: ctest took $(( $(date +%s) - start )) s"
