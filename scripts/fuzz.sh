#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang, ASan and UBSan, and
# runs each for a while over its committed seed corpus. Any crash, sanitizer
# report, leak, timeout or broken property fails the script and leaves the
# input under BUILD_DIR/fuzz-artifacts/<target>/ (add it to the target's
# corpus and a regression test once fixed). New inputs go to a scratch corpus
# in BUILD_DIR, not into the repository.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (default 30)] [BUILD_DIR (default build-asan,
#   the build scripts/sanitize.sh uses too)]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
build_dir=${2:-build-asan}
targets=(forward_request_fuzzer npy_fuzzer kv_ops_fuzzer kserve_infer_fuzzer http_json_fuzzer
  kv_staged_parse_fuzzer)

source scripts/lib-sanitized-build.sh
configure_sanitized_build "$build_dir"
start=$(date +%s)
cmake --build "$build_dir" -j "$(nproc)" --target "${targets[@]}"
echo "fuzz.sh: build took $(( $(date +%s) - start )) s"

export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
status=0
for t in "${targets[@]}"; do
  scratch="$build_dir/fuzz-corpus/$t"
  artifacts="$build_dir/fuzz-artifacts/$t/"
  mkdir -p "$scratch" "$artifacts"
  log="$build_dir/fuzz-$t.log"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a runaway allocation.
  # kv_ops_fuzzer: without the entropic schedule's per-feature bookkeeping,
  # which took more than half its time (one input, a program of up to 40
  # calls, hits tens of thousands of features): 2.3x the executions, the same
  # checks.
  # Its allocation stacks are not recorded either (malloc_context_size=0):
  # a quarter of its CPU time went to unwinding and storing them; a report
  # still has the failing access's stack, and the input reproduces with them.
  extra=()
  asan=$ASAN_OPTIONS
  [ "$t" = kv_ops_fuzzer ] && extra=(-entropic=0) && asan=$ASAN_OPTIONS:malloc_context_size=0
  if ! ASAN_OPTIONS=$asan "$build_dir/tests/fuzz/$t" "${extra[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$artifacts" \
      "$scratch" "tests/fuzz/corpus/$t" > "$log" 2>&1; then
    echo "fuzz.sh: $t FAILED; see $log and $artifacts"
    tail -40 "$log"
    status=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  echo "fuzz.sh: $t: $runs executions in ${seconds} s"
done
exit $status
