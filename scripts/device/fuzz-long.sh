#!/usr/bin/env bash
# Long libFuzzer runs on the 16-core GPU machine (the device tool's `run`),
# for the executions counts tests/fuzz/README.md records.
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
#           is 64 MiB).
#   there:  scripts/device/fuzz-long.sh run SECONDS [TARGETS...]
#           (run with carry [".device-carry"]) unpacks it and runs each
#           target for SECONDS with -fork=$JOBS (default 14: two of the 16
#           cores left to the machine), then prints, per target, the
#           executions in total, the inputs that failed (crashes, sanitizer
#           reports, leaks, timeouts, OOMs) and the corpus size. Failing
#           inputs and logs go to $OUT/fuzz-long/<target>/; exit 1 on any.
#
# Default targets: kserve_infer_fuzzer kv_ops_fuzzer (the two still short of
# 10M executions). Example for the lead (about 20 minutes of 30):
#   scripts/device/fuzz-long.sh pack
#   run carry=[".device-carry"] command="scripts/device/fuzz-long.sh run 270"
# If clang is found on the machine where `run` starts (it was not, when this
# was written) the script says so; it still uses the carried binaries.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
mode=${1:?usage: fuzz-long.sh pack [BUILD_DIR] [TARGETS...] | run SECONDS [TARGETS...]}
shift
default_targets=(kserve_infer_fuzzer kv_ops_fuzzer)
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
  rm -rf "$carry" .device-carry/fuzz.tar.xz
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
  tar -C .device-carry -cJf .device-carry/fuzz.tar.xz fuzz
  rm -rf "$carry"
  du -h .device-carry/fuzz.tar.xz
  exit 0
fi

[ "$mode" = run ] || { echo "fuzz-long.sh: unknown mode $mode" >&2; exit 2; }
seconds=${1:?usage: fuzz-long.sh run SECONDS [TARGETS...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${default_targets[@]}")
jobs=${JOBS:-14}
OUT=${OUT:-$PWD/fuzz-long-out}
if command -v clang++ >/dev/null 2>&1; then
  echo "fuzz-long.sh: clang is here ($(clang++ --version | head -1)); using the carried binaries all the same"
else
  echo "fuzz-long.sh: no clang here (as expected); using the carried binaries"
fi
[ -f .device-carry/fuzz.tar.xz ] || { echo "fuzz-long.sh: no .device-carry/fuzz.tar.xz: run 'pack' here first" >&2; exit 2; }
work=$(mktemp -d)
tar -C "$work" -xJf .device-carry/fuzz.tar.xz || exit 2
export LD_LIBRARY_PATH="$work/fuzz/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
status=0
summary=()
for t in "${targets[@]}"; do
  dir="$OUT/fuzz-long/$t"
  mkdir -p "$dir/artifacts" "$dir/corpus"
  bin="$work/fuzz/bin/$t"
  [ -x "$bin" ] || { echo "fuzz-long.sh: $t was not packed" >&2; status=1; continue; }
  # -fork: jobs child processes, each restarted after a finding, so one
  # crash does not end the run (-ignore_crashes etc.); every finding is kept.
  # kv_ops_fuzzer without the entropic schedule (scripts/fuzz.sh says why).
  extra=()
  [ "$t" = kv_ops_fuzzer ] && extra=(-entropic=0)
  "$bin" "${extra[@]}" -fork="$jobs" -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/" "$dir/corpus" "$work/fuzz/corpus/$t" \
    >"$dir/fuzz.log" 2>&1
  rc=$?
  # The fork mode's progress lines: "#N: cov: .. ft: .. corp: .. exec/s: .. oom/timeout/crash: a/b/c time: .."
  last=$(grep -E '^#[0-9]+: cov:' "$dir/fuzz.log" | tail -1)
  execs=$(echo "$last" | sed -nE 's/^#([0-9]+):.*/\1/p')
  crashes=$(echo "$last" | sed -nE 's/.*oom\/timeout\/crash: ([0-9]+\/[0-9]+\/[0-9]+).*/\1/p')
  found=$(find "$dir/artifacts" -type f | wc -l)
  corpus=$(find "$dir/corpus" -type f | wc -l)
  line="$t: ${execs:-?} executions in $seconds s x $jobs jobs; oom/timeout/crash ${crashes:-?}; $found failing inputs kept; corpus $corpus; exit $rc"
  echo "fuzz-long.sh: $line"
  summary+=("$line")
  if [ "$found" -gt 0 ] || [ "$rc" -ne 0 ]; then status=1; tail -30 "$dir/fuzz.log"; fi
done
rm -rf "$work"
echo "fuzz-long.sh: summary"
printf '  %s\n' "${summary[@]}"
exit $status
