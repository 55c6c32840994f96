#!/usr/bin/env bash
# Long libFuzzer runs on a GPU machine (the device tool's `run`), for the
# execution counts tests/fuzz/README.md records, meant to run in the
# background of GPU work.
#
# The GPU machine has g++ but no clang, and no gRPC, protobuf or Abseil
# (docs: /work/shared/PLATFORM.md), so the fuzzers cannot be built there:
# they are built here with clang (scripts/fuzz.sh's ASan + UBSan + libFuzzer
# configuration) and carried with the shared libraries they load, as
# pack-device-deps.sh carries the server. Two steps:
#
#   here:   scripts/device/fuzz-long.sh pack [BUILD_DIR (default build-asan)] [TARGETS...]
#           builds the targets, writes .device-carry/fuzz.tar.xz (binaries,
#           libraries, seed corpora) and prints its size (the carry limit
#           is 64 MiB for everything a call carries).
#   there:  [JOBS=N] [NICE=10] scripts/device/fuzz-long.sh run SECONDS [TARGETS...]
#           (run with carry [".device-carry"]) unpacks it and runs JOBS
#           workers (default: the cores less two) at `nice -n $NICE`, the
#           targets one after another, sharing SECONDS between them; it ends
#           by itself within SECONDS of starting. Each worker is a plain
#           libFuzzer process, restarted after a finding and every ROUND
#           seconds (default 600: a restart replays the whole shared corpus);
#           the workers share one corpus directory (libFuzzer reloads what the
#           others add). $OUT/fuzz-long/totals.txt holds the
#           executions so far per target, rewritten every 10 s, so a run
#           killed at its end still says what it did; failing inputs, logs
#           and the inputs the run added (corpus.tar.gz) go to
#           $OUT/fuzz-long/<target>/; exit 1 on any finding.
#
# Default target: kv_ops_fuzzer (the one still short of 10M executions).
# Example for the lead, in the background of a ~550 s GPU call on 32 cores:
#   scripts/device/fuzz-long.sh pack
#   run carry=[".device-carry"] command="JOBS=24 scripts/device/fuzz-long.sh run 540 & <GPU work>; wait"
# If clang is found on the machine where `run` starts the script says so;
# it still uses the carried binaries.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
mode=${1:?usage: fuzz-long.sh pack [BUILD_DIR] [TARGETS...] | run SECONDS [TARGETS...]}
shift
default_targets=(kv_ops_fuzzer)
carry=.device-carry/fuzz

if [ "$mode" = pack ]; then
  set -e
  build=${1:-build-asan}
  [ $# -gt 0 ] && shift
  targets=("${@:-${default_targets[@]}}")
  [ ${#targets[@]} -gt 0 ] || targets=("${default_targets[@]}")
  source scripts/lib-sanitized-build.sh
  configure_sanitized_build "$build" >/dev/null
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
  rm -rf "$carry"
  mkdir -p "$carry/bin" "$carry/lib" "$carry/corpus"
  for t in "${targets[@]}"; do
    strip --strip-debug -o "$carry/bin/$t" "$build/tests/fuzz/$t"
    cp -a "tests/fuzz/corpus/$t" "$carry/corpus/"
  done
  # Every shared library but glibc's and the compiler runtime's (newer there,
  # backward compatible); the sanitizer runtimes are linked in statically.
  ldd "$carry"/bin/* | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libdl|librt|libpthread|libresolv|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so' |
    while read -r lib; do cp -L "$lib" "$carry/lib/"; done
  strip --strip-unneeded "$carry"/lib/*.so* 2>/dev/null || true
  # Written aside and renamed: a carry taken meanwhile gets the old one whole.
  tar -C .device-carry -cJf .device-carry/fuzz.tar.xz.new fuzz
  mv .device-carry/fuzz.tar.xz.new .device-carry/fuzz.tar.xz
  rm -rf "$carry"
  du -h .device-carry/fuzz.tar.xz
  exit 0
fi

[ "$mode" = run ] || { echo "fuzz-long.sh: unknown mode $mode" >&2; exit 2; }
seconds=${1:?usage: fuzz-long.sh run SECONDS [TARGETS...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${default_targets[@]}")
t_start=$(date +%s)
t_end=$((t_start + seconds))
cores=$(nproc)
jobs=${JOBS:-$((cores > 2 ? cores - 2 : 1))}
niceness=${NICE:-10}
round=${ROUND:-600}
OUT=${OUT:-$PWD/fuzz-long-out}
top="$OUT/fuzz-long"
mkdir -p "$top"
if command -v clang++ >/dev/null 2>&1; then
  echo "fuzz-long.sh: clang is here ($(clang++ --version | head -1)); using the carried binaries all the same"
else
  echo "fuzz-long.sh: no clang here (as expected); using the carried binaries"
fi
[ -f .device-carry/fuzz.tar.xz ] || { echo "fuzz-long.sh: no .device-carry/fuzz.tar.xz: run 'pack' here first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf .device-carry/fuzz.tar.xz || exit 2
export LD_LIBRARY_PATH="$work/fuzz/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
asan_default=halt_on_error=1:detect_leaks=1

# Executions of one target so far: every run's last "#N" (its final count
# once it has ended; its latest progress line while it runs).
executions() {
  local n=0 f last
  for f in "$top/$1"/logs/*.log; do
    [ -f "$f" ] || continue
    last=$(grep -aoE '^#[0-9]+' "$f" | tail -1)
    last=${last#\#}
    n=$((n + ${last:-0}))
  done
  echo "$n"
}
write_totals() {
  local t
  {
    echo "as of $(date -u +%FT%TZ), $(($(date +%s) - t_start)) s of $seconds, $jobs workers"
    for t in "${targets[@]}"; do
      [ -d "$top/$t/logs" ] || continue
      echo "$t: $(executions "$t") executions; $(find "$top/$t/artifacts" -type f | wc -l) failing inputs kept"
    done
  } >"$top/totals.txt.new" && mv "$top/totals.txt.new" "$top/totals.txt"
}

# One worker: libFuzzer runs of at most `round` seconds until `until`;
# each run is interrupted (SIGINT: libFuzzer still prints its final
# stats) if it is still going at `hard`.
worker() {
  local t=$1 w=$2 until=$3 hard=$4 dir="$top/$1" r=0 left
  while left=$((until - $(date +%s))); [ "$left" -ge 3 ]; do
    r=$((r + 1))
    [ "$left" -gt "$round" ] && left=$round
    # shellcheck disable=SC2086
    ASAN_OPTIONS=${asan_opts[$t]:-$asan_default} timeout -s INT -k 2 $((hard - $(date +%s))) \
      nice -n "$niceness" "$bin" ${extra[$t]:-} \
      -max_total_time="$left" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$dir/artifacts/" "$work/corpus-$t" "$work/fuzz/corpus/$t" \
      >"$dir/logs/w$w-r$r.log" 2>&1 </dev/null
  done
}

# Per-target libFuzzer flags and sanitizer options (tests/fuzz/README.md
# says why): kv_ops_fuzzer without the entropic schedule and with short
# allocation stacks in reports (a finding's input reproduces with full ones).
declare -A extra=([kv_ops_fuzzer]=-entropic=0)
declare -A asan_opts=([kv_ops_fuzzer]=$asan_default:malloc_context_size=0)
status=0
left_targets=${#targets[@]}
for t in "${targets[@]}"; do
  dir="$top/$t"
  mkdir -p "$dir/artifacts" "$dir/logs" "$work/corpus-$t"
  bin="$work/fuzz/bin/$t"
  left_targets=$((left_targets - 1))
  [ -x "$bin" ] || { echo "fuzz-long.sh: $t was not packed" >&2; status=1; continue; }
  # This target's share of what is left, less a few seconds for the last
  # input, the exit's leak check, the final stats and the totals.
  share=$(( (t_end - $(date +%s) - 3) / (left_targets + 1) ))
  hard=$(( $(date +%s) + share ))
  until=$(( hard - 2 ))
  echo "fuzz-long.sh: $t: $jobs workers for $share s (nice $niceness, rounds of $round s)"
  pids=()
  for w in $(seq 1 "$jobs"); do
    worker "$t" "$w" "$until" "$hard" &
    pids+=($!)
  done
  tick=0
  while kill -0 "${pids[@]}" 2>/dev/null; do
    [ $((tick % 10)) -eq 0 ] && write_totals
    tick=$((tick + 1))
    sleep 1
  done
  wait "${pids[@]}"
  write_totals
  found=$(find "$dir/artifacts" -type f | wc -l)
  # The inputs the run added, as one file (thousands of small ones are slow
  # to bring back).
  corpus=$(find "$work/corpus-$t" -type f | wc -l)
  tar -C "$work" -czf "$dir/corpus.tar.gz" "corpus-$t"
  cov=$(grep -ahoE 'cov: [0-9]+ ft: [0-9]+' "$dir"/logs/*.log | sort -t' ' -k2,2n | tail -1)
  echo "fuzz-long.sh: $t: $(executions "$t") executions in $share s x $jobs workers; $found failing inputs kept; corpus $corpus new inputs; best worker ${cov:-?}"
  if [ "$found" -gt 0 ]; then
    status=1
    grep -alE 'ERROR|SUMMARY|deadly signal|fuzz check failed' "$dir"/logs/*.log | head -3 |
      while read -r f; do echo "--- $f"; grep -aE -A12 'ERROR|deadly signal|fuzz check failed' "$f" | head -30; done
  fi
done
echo "fuzz-long.sh: summary ($(($(date +%s) - t_start)) s)"
cat "$top/totals.txt"
exit $status
