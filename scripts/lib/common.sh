# shellcheck shell=bash
# What the scripts under scripts/ and bench/ share: polling for a condition
# with a deadline, starting a server and waiting until it answers SERVING, a
# free loopback port, reading one Prometheus metric, a gtest log's totals,
# and on the GPU machine the library path for the carried libraries, the
# carried Python client and server, and the CUDA build. Source it:
#   . "$(dirname "$0")/lib/common.sh"            (from scripts/)
# Nothing here exits the caller: functions return non-zero and the caller
# decides.

# wait_until TIMEOUT_S INTERVAL_S CMD...: runs CMD (output discarded) every
# INTERVAL_S seconds until it succeeds (returns 0) or TIMEOUT_S seconds have
# passed (returns 1). CMD runs at least once.
wait_until() {
  local timeout=$1 interval=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep "$interval"
  done
}

# wait_serving TIMEOUT_S CLIENT...: waits until `CLIENT... health` exits 0
# (grpc.health.v1 says SERVING). CLIENT is an attnctl command line with its
# target, e.g. `attnctl --target=127.0.0.1:50051` or
# `podman exec CTR attnctl --timeout=2s`. Polls every 0.2 s; 1 on timeout.
wait_serving() {
  local timeout=$1
  shift
  wait_until "$timeout" 0.2 "$@" health
}

# start_server LOG TIMEOUT_S CLIENT... -- SERVER...: starts SERVER... in the
# background with stdout and stderr to LOG, sets SERVER_PID, and waits up to
# TIMEOUT_S seconds for it to answer SERVING through CLIENT... (as
# wait_serving). On timeout prints LOG's last 20 lines and returns 1 (the
# server is left running: SERVER_PID is set for the caller's cleanup).
start_server() {
  local log=$1 timeout=$2
  shift 2
  local client=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    client+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift  # the --
  "$@" >"$log" 2>&1 &
  # shellcheck disable=SC2034  # read by the caller
  SERVER_PID=$!
  if ! wait_serving "$timeout" "${client[@]}"; then
    echo "server ($*) did not become SERVING within ${timeout} s; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    return 1
  fi
}

# free_port: prints a TCP port on 127.0.0.1 that was free a moment ago.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# scrape_metrics URL: prints the Prometheus text at URL (e.g.
# http://127.0.0.1:8002/metrics); non-zero when it cannot be read.
scrape_metrics() {
  python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

# metric_value URL NAME: prints the value of the first sample of metric NAME
# (with or without labels) at the Prometheus endpoint URL; prints nothing and
# returns 1 when the endpoint cannot be read or has no such sample.
metric_value() {
  local text value
  text=$(scrape_metrics "$1" 2>/dev/null) || return 1
  value=$(printf '%s\n' "$text" | awk -v name="$2" \
    'index($0, name) == 1 && substr($0, length(name) + 1, 1) ~ /[{ ]/ {print $NF; exit}')
  [ -n "$value" ] || return 1
  printf '%s\n' "$value"
}

# use_carried_libs WHAT...: on the GPU machine (from the repository root),
# prepends to LD_LIBRARY_PATH, in order, the libraries that
# scripts/device/pack-device-deps.sh carried: `absl` (the Abseil the backend tests
# and benchmarks link) and `lib` (a shared-library server's, when
# .device-carry/lib exists). The last one named comes first on the path.
use_carried_libs() {
  local what
  for what in "$@"; do
    case $what in
      absl) export LD_LIBRARY_PATH=$PWD/.device-carry/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;;
      lib) [ -d .device-carry/lib ] && export LD_LIBRARY_PATH=$PWD/.device-carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;;
      *) echo "use_carried_libs: expected absl or lib, got '$what'" >&2; return 2 ;;
    esac
  done
  return 0
}

# gtest_counts LOG: a gtest binary's outcome from its LOG on one line: its
# PASSED, FAILED and SKIPPED totals (nothing when it died before them, which
# its exit status shows).
gtest_counts() {
  grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]|^\[  SKIPPED \] [0-9]' "$1" | tr '\n' ' '
}

# cuda_build SRC DIR LOG [-DNAME=VALUE...] TARGET...: on the GPU machine
# (from the repository root), configures the source tree SRC into the build
# folder DIR (server off, CUDA on, sm_90, the carried Abseil, KERNELS's kernel
# set, all when unset; CUDA_FLAGS's extra nvcc flags, none when unset; the -D
# arguments passed on to cmake) and builds TARGET... with ninja. A folder
# built before is reused: ninja rebuilds what changed. LOG gets cmake's and
# ninja's output; on failure its error lines are printed and the status is
# non-zero.
cuda_build() {
  local src=$1 dir=$2 log=$3
  shift 3
  local cmake_args=() ninja_targets=() a
  for a in "$@"; do
    case $a in
      -D*) cmake_args+=("$a") ;;
      *) ninja_targets+=("$a") ;;
    esac
  done
  if cmake -S "$src" -B "$dir" -G Ninja -DATTNSERVE_BUILD_SERVER=OFF -DATTNSERVE_CUDA=ON \
       -DCMAKE_PREFIX_PATH="$PWD/.device-carry/absl" -DCMAKE_CUDA_ARCHITECTURES=90-real \
       -DATTNSERVE_CUDA_KERNELS="${KERNELS:-all}" -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" \
       ${cmake_args[@]+"${cmake_args[@]}"} >"$log" 2>&1 &&
     ninja -C "$dir" -j16 "${ninja_targets[@]}" >>"$log" 2>&1; then
    return 0
  fi
  echo "cuda_build: building ${ninja_targets[*]} in $dir failed; from $log:" >&2
  grep -E 'error|Error|FAILED' "$log" | head -30 >&2
  return 1
}

# use_carried_python CARRY PYTHON: on the GPU machine, the carried Python
# client and server (scripts/device/pack-python-carry.sh, pack-device-deps.sh
# --server): installs CARRY/wheels/*.whl with PYTHON into CARRY/pylib (no
# index) and puts it first on PYTHONPATH; unpacks CARRY/server.tgz when
# CARRY/bin has no server; writes CARRY/pybin/attnserve and attnctl, wrappers
# that put CARRY/lib on those two's library path alone (the machine's Python
# loads the machine's libraries). Sets CARRIED_COMMIT to the wheels' commit
# ("unknown" when not recorded). Returns 2, saying what is missing, when
# something is.
use_carried_python() {
  local carry=$1 py=$2 tool
  [ -d "$carry"/wheels ] ||
    { echo "no $carry/wheels: run scripts/device/pack-python-carry.sh here and carry it"; return 2; }
  rm -rf "$carry"/pylib
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$carry"/pylib \
    "$carry"/wheels/*.whl || return 2
  export PYTHONPATH=$carry/pylib${PYTHONPATH:+:$PYTHONPATH}
  # shellcheck disable=SC2034  # read by the caller
  CARRIED_COMMIT=$(cat "$carry"/wheels/COMMIT 2>/dev/null || echo unknown)
  if [ ! -x "$carry"/bin/attnserve ] && [ -f "$carry"/server.tgz ]; then
    tar -C "$carry" -xzf "$carry"/server.tgz || return 2
  fi
  if [ ! -x "$carry"/bin/attnserve ] || [ ! -x "$carry"/bin/attnctl ]; then
    echo "no $carry/bin/attnserve and attnctl: scripts/device/pack-device-deps.sh --server BUILD"
    return 2
  fi
  rm -rf "$carry"/pybin
  mkdir -p "$carry"/pybin
  for tool in attnserve attnctl; do
    # shellcheck disable=SC2016  # ${LD_LIBRARY_PATH...} and "$@" are the wrapper's
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
      "$carry/lib" "$carry/bin/$tool" >"$carry/pybin/$tool"
    chmod +x "$carry/pybin/$tool"
  done
}
