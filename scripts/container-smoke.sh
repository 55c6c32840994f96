#!/usr/bin/env bash
# One command that builds the CPU container image with podman and smoke-tests
# it the way a `docker run` user would use it, on a machine with no registry
# and no Docker engine (docs/containers.md):
#   1. installs podman, debootstrap, runc, uidmap, iptables when missing and
#      points CONTAINERS_CONF at a containers.conf that uses runc;
#   2. makes the base image localhost/debian:bookworm with debootstrap
#      (scripts/make-base-image.sh; skipped when it exists);
#   3. podman build -f deploy/Dockerfile.cpu --build-arg BASE=localhost/debian:bookworm;
#   4. runs it with -p 127.0.0.1:PORT:50051, waits for grpc.health.v1 SERVING,
#      runs the image's own HEALTHCHECK, checks the non-root user, runs
#      `attnctl forward --verify` (FP16, BF16 causal GQA, FP32 windowed, varlen)
#      and a short load through the published port, then sends SIGTERM while a
#      request is in flight (two requests that cannot share a launch: the
#      /metrics pending-request gauge shows the second queued behind the first)
#      and checks that both finished and the container exited 0 before any
#      SIGKILL;
#   5. with --gpu-build-stage, also builds the GPU image's build stage
#      (deploy/Dockerfile --target build) on the Debian base with the CUDA
#      toolkit copied in from /usr/local/cuda. It cannot run here (no GPU).
# Prints PASS/FAIL per check and a timing table; exits non-zero on any FAIL.
# Needs root (apt-get, debootstrap, rootful podman).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/container-smoke.sh [options]

  --port N            host port to publish 50051 on (default: a free one)
  --load-seconds N    length of the short `attnctl load` (default: 3)
  --jobs N            compile jobs inside the image build (default: nproc)
  --no-build          reuse the existing localhost/attnserve:cpu image
  --gpu-build-stage   also build deploy/Dockerfile --target build on the local
                      Debian + /usr/local/cuda base (slow: compiles CUDA kernels),
                      then the whole GPU image with its runtime stage on the
                      Debian base, run without a GPU (CPU fallback); the static
                      binaries are left in build-container/gpu-out/
  --gpu-only          only the GPU build stage (implies --gpu-build-stage)
  --cuda-archs LIST   CUDA architectures for --gpu-build-stage (default: the
                      Dockerfile's, "80;90a")
  --cuda-kernels SET  dev (head dim 128 only, default here: fits the 2-core
                      machine) or all (every instantiation, as a release builds)
  --keep              leave the test container behind (stopped) for inspection
  -h, --help          this text

Environment: CONTAINERS_CONF (default: a generated build-container/containers.conf),
ATTNSERVE_CONTAINER_DIR (scratch folder, default build-container/).
EOF
}

cd "$(dirname "$0")/.."
repo=$(pwd)
# shellcheck source=scripts/lib/common.sh
. scripts/lib/common.sh
port=""
load_seconds=3
jobs=""
build=1
gpu_stage=0
cpu_smoke=1
cuda_archs=""
cuda_kernels=dev
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    --port=*) port=${1#*=}; shift ;;
    --load-seconds) load_seconds=$2; shift 2 ;;
    --load-seconds=*) load_seconds=${1#*=}; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --jobs=*) jobs=${1#*=}; shift ;;
    --no-build) build=0; shift ;;
    --gpu-build-stage) gpu_stage=1; shift ;;
    --gpu-only) gpu_stage=1; cpu_smoke=0; shift ;;
    --cuda-archs) cuda_archs=$2; shift 2 ;;
    --cuda-archs=*) cuda_archs=${1#*=}; shift ;;
    --cuda-kernels) cuda_kernels=$2; shift 2 ;;
    --cuda-kernels=*) cuda_kernels=${1#*=}; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "container-smoke: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "container-smoke: $*" >&2; exit 1; }
log() { echo "container-smoke: $*"; }
[ "$(id -u)" -eq 0 ] || die "needs root (apt-get, debootstrap and rootful podman)"

base_image=localhost/debian:bookworm
cpu_image=localhost/attnserve:cpu
cuda_devel_image=localhost/attnserve-cuda-devel:13.0-bookworm
gpu_build_image=localhost/attnserve:cuda-build
work=${ATTNSERVE_CONTAINER_DIR:-$repo/build-container}
mkdir -p "$work"

# --- results and timings ------------------------------------------------------
results=()
timings=()
failed=0
pass() { results+=("PASS  $1"); log "PASS $1"; }
fail() { results+=("FAIL  $1"); log "FAIL $1"; failed=1; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
timed() { timings+=("$(printf '%-44s %8s s' "$1" "$2")"); }
summary() {
  echo
  echo "==== container-smoke summary ===="
  printf '%s\n' "${results[@]}"
  # The plain count line that CI log readers recognise.
  echo "container-smoke: $(printf '%s\n' "${results[@]}" | grep -c '^PASS') passed, $(printf '%s\n' "${results[@]}" | grep -c '^FAIL') failed"
  echo "---- timings ----"
  printf '%s\n' "${timings[@]}"
  if [ "$failed" -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
}

# --- 1. tools and configuration ----------------------------------------------
t0=$(now)
need=()
for cmd_pkg in podman:podman debootstrap:debootstrap runc:runc newuidmap:uidmap iptables:iptables; do
  command -v "${cmd_pkg%%:*}" >/dev/null || need+=("${cmd_pkg#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  # iptables: netavark sets up published ports with it and fails without it.
  log "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ -z "${CONTAINERS_CONF:-}" ]; then
  # crun fails on this machine's cgroups and podman's default ulimits are not
  # permitted here; these settings are the ones seen to work (PLATFORM.md).
  export CONTAINERS_CONF=$work/containers.conf
  cat >"$CONTAINERS_CONF" <<'EOF'
# Written by scripts/container-smoke.sh: podman settings that work on the
# development machine (runc instead of crun; ulimits the host permits).
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
fi
driver=$(podman info --format '{{.Store.GraphDriverName}}')
# vfs copies every layer in full: builds take many times longer.
[ "$driver" = overlay ] || log "warning: podman storage driver is '$driver', not overlay: expect slow builds"
timed "tools + containers.conf" "$(took "$t0")"

# --- 2. base image ------------------------------------------------------------
t0=$(now)
scripts/make-base-image.sh --image "$base_image"
timed "base image ($base_image)" "$(took "$t0")"

image_size() { podman image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.0f MB", $1 / 1e6 }'; }

# --- 3..4. CPU image build and smoke test -----------------------------------
if [ "$cpu_smoke" -eq 1 ]; then
  if [ "$build" -eq 1 ]; then
    t0=$(now)
    # --format docker: the OCI format has no HEALTHCHECK, and the check below
    # runs the image's own.
    if podman build --format docker -f deploy/Dockerfile.cpu \
         --build-arg BASE="$base_image" ${jobs:+--build-arg JOBS="$jobs"} \
         -t "$cpu_image" . >"$work/build-cpu.log" 2>&1; then
      pass "podman build deploy/Dockerfile.cpu ($(image_size "$cpu_image"))"
    else
      tail -n 40 "$work/build-cpu.log"
      fail "podman build deploy/Dockerfile.cpu (log: $work/build-cpu.log)"
      summary; exit 1
    fi
    timed "CPU image build" "$(took "$t0")"
    grep -E '^build-in-image: (compiled|bundled)' "$work/build-cpu.log" || true
  fi
  podman image exists "$cpu_image" || die "$cpu_image does not exist (drop --no-build)"

  [ -n "$port" ] || port=$(free_port)
  metrics_port=$(free_port)
  ctr=attnserve-smoke-$$
  cleanup() {
    if [ "$keep" -eq 0 ]; then podman rm -f "$ctr" >/dev/null 2>&1 || true; fi
  }
  trap cleanup EXIT

  # attnctl from the image, on the host's network: every call goes through
  # the published port, as an outside client's would.
  # --no-healthcheck: these short-lived containers need no health timer.
  ctl() {
    podman run --rm --network host --no-healthcheck "$cpu_image" \
      attnctl --target="127.0.0.1:$port" "$@"
  }

  t0=$(now)
  # podman runs a HEALTHCHECK from systemd timers, which this machine lacks
  # (and tearing them down slows `podman stop` by seconds): run without it and
  # execute the image's HEALTHCHECK command directly below.
  podman run -d --name "$ctr" -p "127.0.0.1:$port:50051" -p "127.0.0.1:$metrics_port:8002" \
    --no-healthcheck \
    -e ATTNSERVE_LOG_LEVEL=debug "$cpu_image" >/dev/null 2>"$work/run.log"
  if wait_serving 60 podman exec "$ctr" attnctl --timeout=2s; then
    pass "health SERVING inside the container"
  else
    podman logs "$ctr" | tail -n 20
    fail "health SERVING inside the container (not within 60 s)"
    summary; exit 1
  fi
  timed "start to SERVING" "$(took "$t0")"

  if out=$(ctl health 2>&1) && [ "$out" = SERVING ]; then
    pass "attnctl health through 127.0.0.1:$port: $out"
  else
    fail "attnctl health through 127.0.0.1:$port: $out"
  fi
  # The image's HEALTHCHECK command itself (what docker/compose will run),
  # taken from the image config: ["CMD", argv...] or ["CMD-SHELL", "line"].
  hc_argv=$(podman image inspect --format '{{json .Config.Healthcheck.Test}}' "$cpu_image" \
    | python3 -c 'import json, shlex, sys
t = json.load(sys.stdin) or []
argv = t[1:] if t[:1] == ["CMD"] else (["/bin/sh", "-c", t[1]] if t[:1] == ["CMD-SHELL"] else [])
print(shlex.join(argv))')
  if [ -z "$hc_argv" ]; then
    fail "image HEALTHCHECK: the image has none (built without --format docker?)"
  elif eval "podman exec $ctr $hc_argv" >"$work/healthcheck.log" 2>&1; then
    pass "image HEALTHCHECK ($hc_argv): $(cat "$work/healthcheck.log")"
  else
    fail "image HEALTHCHECK ($hc_argv): $(cat "$work/healthcheck.log")"
  fi
  uid=$(podman exec "$ctr" id -u)
  if [ "$uid" != 0 ]; then pass "runs as non-root (uid $uid)"; else fail "runs as root"; fi
  if info=$(ctl info 2>&1); then
    pass "attnctl info ($(echo "$info" | grep -i -m1 backend | tr -s ' ' | head -c 60))"
  else
    fail "attnctl info: $info"
  fi

  t0=$(now)
  verify_cases=(
    "--dtype=fp16 --batch=2 --seqlen_q=128 --heads_q=8 --head_dim=64"
    "--dtype=bf16 --batch=2 --seqlen_q=97 --seqlen_k=211 --heads_q=8 --heads_kv=2 --head_dim=128 --causal"
    "--dtype=fp32 --batch=1 --seqlen_q=64 --heads_q=4 --head_dim=32 --window_left=16 --window_right=0 --return_lse"
    "--dtype=bf16 --varlen_q=5,0,17 --varlen_k=9,3,17 --heads_q=4 --heads_kv=1 --head_dim=64 --causal"
  )
  for args in "${verify_cases[@]}"; do
    # shellcheck disable=SC2086  # args is a list of flags on purpose
    if out=$(ctl forward --verify $args 2>&1); then
      pass "forward --verify $args"
    else
      echo "$out" | tail -n 5
      fail "forward --verify $args"
    fi
  done
  timed "forward --verify x${#verify_cases[@]}" "$(took "$t0")"

  # Short load: attnctl load from inside the image (host network), every
  # response checked against the float64 reference; exit 0 means no errors.
  t0=$(now)
  if load_out=$(podman run --rm --network host --no-healthcheck "$cpu_image" \
                  attnctl --target="127.0.0.1:$port" load --concurrency=4 --warmup=0s \
                  --duration="${load_seconds}s" --dtype=bf16 --batch=2 --seqlen_q=256 \
                  --heads_q=8 --heads_kv=2 --head_dim=64 --causal --check 2>/dev/null); then
    pass "load: $(echo "$load_out" | grep -m1 '^concurrency=')"
  else
    echo "$load_out" | tail -n 5
    fail "attnctl load --check reported errors"
  fi
  load_s=$(took "$t0")

  # Prometheus metrics through the published port 8002: the requests above
  # must show up as successes.
  metrics_url=http://127.0.0.1:$metrics_port/metrics
  successes=$(metric_value "$metrics_url" nv_inference_request_success) || true
  if [ -n "$successes" ] && [ "${successes%.*}" -gt 0 ] 2>/dev/null; then
    pass "/metrics on published port 8002: nv_inference_request_success $successes"
  else
    scrape_metrics "$metrics_url" 2>&1 | head -n 5 || true
    fail "/metrics on published port 8002 (no nv_inference_request_success > 0)"
  fi
  timed "attnctl load (${load_seconds} s, 4 callers)" "$load_s"

  # SIGTERM with requests in flight: they must finish (drain) and the server
  # must exit 0 by itself, before podman's SIGKILL at 30 s. Each of the two
  # requests is sized to take about 3 s here (about 6 s of drain in all): one
  # calibration call at Sq = Sk = 2048, then Sq scaled by sqrt(3 s / its
  # time), as the work grows with Sq * Sk.
  calib_ms=$(ctl forward --dtype=bf16 --batch=1 --seqlen_q=2048 --heads_q=16 --head_dim=128 \
               2>/dev/null | grep -o 'server total [0-9.]*' | awk '{print $3}')
  inflight_sq=$(awk -v ms="${calib_ms:-1000}" 'BEGIN {
    sq = 2048 * sqrt(3000 / (ms > 1 ? ms : 1)); sq = int(sq / 128) * 128
    print (sq < 2048 ? 2048 : (sq > 32768 ? 32768 : sq)) }')
  log "in-flight requests: Sq = Sk = $inflight_sq (calibration at 2048: ${calib_ms:-?} ms)"
  # SIGTERM goes out only once the server holds the requests, shown by its
  # own /metrics: two requests of different dtypes (which never share a
  # launch) sent at once, so while one computes the other waits in the queue
  # and nv_inference_pending_request_count reads 1. A request that has not
  # reached the server yet would be refused with UNAVAILABLE (correctly), so
  # a fixed delay before SIGTERM fails on a loaded machine.
  client_ctr=$ctr-client
  inflight_args="--seqlen_q=$inflight_sq --batch=1 --heads_q=16 --head_dim=128"
  podman run -d --name "$client_ctr" --network host --no-healthcheck "$cpu_image" sh -c "
    attnctl --target=127.0.0.1:$port forward --dtype=bf16 $inflight_args \
      --request_id=smoke-inflight-bf16 & first=\$!
    attnctl --target=127.0.0.1:$port forward --dtype=fp16 $inflight_args \
      --request_id=smoke-inflight-fp16; second=\$?
    wait \$first && exit \$second" >/dev/null
  # Two readings 0.2 s apart: a request that finds the launcher idle is queued
  # for microseconds only, so a lasting 1 means one computes and one waits.
  queued() { [ "$(metric_value "$metrics_url" nv_inference_pending_request_count)" = 1 ]; }
  queued_twice() { queued && sleep 0.2 && queued; }
  t0=$(now)
  if wait_until 60 0.1 queued_twice; then
    log "both requests held by the server after $(took "$t0") s (pending-request gauge: 1)"
  else
    fail "the server did not show a queued request within 60 s (nv_inference_pending_request_count)"
  fi
  t0=$(now)
  podman stop -t 30 "$ctr" >/dev/null 2>>"$work/run.log"
  stop_s=$(took "$t0")
  client_rc=$(podman wait "$client_ctr")
  podman logs "$client_ctr" >"$work/inflight.log" 2>&1 || true
  podman rm -f "$client_ctr" >/dev/null 2>&1 || true
  if [ "$client_rc" = 0 ]; then
    pass "in-flight requests finished across SIGTERM ($(grep -o 'server total [0-9.]* ms' "$work/inflight.log" | tr '\n' ' '))"
  else
    tail -n 3 "$work/inflight.log"
    fail "in-flight requests finished across SIGTERM (attnctl exit $client_rc)"
  fi
  # Exit code 0 means attnserve ended by itself; podman's SIGKILL after the
  # 30 s stop timeout would show as 137.
  exit_code=$(podman inspect --format '{{.State.ExitCode}}' "$ctr")
  podman logs "$ctr" >"$work/server.log" 2>&1 || true
  drained=$(grep -o -m1 'stopped after [0-9.]*[a-z]*' "$work/server.log" | awk '{print $3}')
  if [ "$exit_code" = 0 ]; then
    pass "SIGTERM: exit code 0 (server drained and stopped after ${drained:-?}; podman stop took $stop_s s)"
  else
    tail -n 10 "$work/server.log"
    fail "SIGTERM: exit code $exit_code after $stop_s s"
  fi
  timed "stop (SIGTERM with two requests in flight)" "$stop_s"
  # Order in the server's log: draining starts, then the queued request (the
  # last of the two to complete) completes (a successful call's line is at
  # debug, the level the container runs at here).
  drain_line=$(grep -n -m1 'draining' "$work/server.log" | cut -d: -f1) || true
  req_line=$(grep -n 'smoke-inflight' "$work/server.log" | tail -n 1 | cut -d: -f1) || true
  if [ -n "$drain_line" ] && [ -n "$req_line" ] && [ "$drain_line" -lt "$req_line" ]; then
    pass "server log: drain began (line $drain_line) before the in-flight request completed (line $req_line)"
  else
    fail "server log: drain line '${drain_line:-none}', request line '${req_line:-none}' (log: $work/server.log)"
  fi
fi

# --- 5. the GPU image's build stage ------------------------------------------
if [ "$gpu_stage" -eq 1 ]; then
  cuda=/usr/local/cuda
  [ -x "$cuda/bin/nvcc" ] || die "--gpu-build-stage needs the CUDA toolkit at $cuda"
  t0=$(now)
  if ! podman image exists "$cuda_devel_image"; then
    # Stands in for nvidia/cuda:*-devel: only what nvcc and CMake need to
    # build (compiler, headers, the static runtime, the driver stub), about
    # 220 MB instead of the whole toolkit.
    tmp_ctr=attnserve-cuda-devel-$$
    podman run --name "$tmp_ctr" -v "$cuda:/host-cuda:ro" "$base_image" sh -c '
      set -e
      mkdir -p /usr/local/cuda
      cd /host-cuda
      tar -c bin nvvm include targets lib64 lib/cmake lib/stubs \
          lib/libcudart* lib/libcudadevrt.a lib/libculibos.a | tar -C /usr/local/cuda -x'
    podman commit -q \
      --change 'ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV CUDA_HOME=/usr/local/cuda' \
      "$tmp_ctr" "$cuda_devel_image" >/dev/null
    podman rm "$tmp_ctr" >/dev/null
  fi
  timed "CUDA devel stand-in image" "$(took "$t0")"
  t0=$(now)
  if podman build --format docker -f deploy/Dockerfile --target build \
       --build-arg BUILD_BASE="$cuda_devel_image" \
       ${cuda_archs:+--build-arg CUDA_ARCHS="$cuda_archs"} \
       --build-arg CMAKE_ARGS="-DATTNSERVE_CUDA_KERNELS=$cuda_kernels" \
       ${jobs:+--build-arg JOBS="$jobs"} \
       -t "$gpu_build_image" . >"$work/build-gpu-stage.log" 2>&1; then
    pass "podman build deploy/Dockerfile --target build (CUDA on, kernels: $cuda_kernels, archs: ${cuda_archs:-Dockerfile default})"
    grep -E '^build-in-image: (compiled|WARNING)|CUDA backend' "$work/build-gpu-stage.log" || true
    gpu_stage_ok=1
  else
    tail -n 40 "$work/build-gpu-stage.log"
    fail "podman build deploy/Dockerfile --target build (log: $work/build-gpu-stage.log)"
    gpu_stage_ok=0
  fi
  timed "GPU build stage ($cuda_kernels kernels)" "$(took "$t0")"

  if [ "$gpu_stage_ok" -eq 1 ]; then
    # The whole GPU Dockerfile, its runtime stage on the Debian base instead of
    # nvidia/cuda:*-runtime (the build stage is cached, so this is quick), run
    # without a GPU: --backend=auto must fall back to the CPU backend.
    t0=$(now)
    gpu_image=localhost/attnserve:cuda-on-debian
    if ! podman build --format docker -f deploy/Dockerfile \
      --build-arg BUILD_BASE="$cuda_devel_image" --build-arg RUNTIME_BASE="$base_image" \
      ${cuda_archs:+--build-arg CUDA_ARCHS="$cuda_archs"} \
      --build-arg CMAKE_ARGS="-DATTNSERVE_CUDA_KERNELS=$cuda_kernels" \
      ${jobs:+--build-arg JOBS="$jobs"} \
      -t "$gpu_image" . >>"$work/build-gpu-stage.log" 2>&1; then
      tail -n 20 "$work/build-gpu-stage.log"
      fail "podman build deploy/Dockerfile (runtime stage on $base_image)"
      summary; exit 1
    fi
    # Keep the binaries for a run on a GPU machine (they are static).
    rm -rf "$work/gpu-out"
    out_ctr=$(podman create "$gpu_build_image" true)
    podman cp "$out_ctr:/out/usr/local/bin" "$work/gpu-out" && podman rm "$out_ctr" >/dev/null
    gctr=attnserve-smoke-gpu-$$
    podman run -d --name "$gctr" --no-healthcheck "$gpu_image" >/dev/null
    for _ in $(seq 1 120); do
      podman exec "$gctr" attnctl health --timeout=2s >/dev/null 2>&1 && break
      sleep 0.5
    done
    backend=$(podman exec "$gctr" attnctl info 2>&1 | awk '/^backend:/ {print $2}')
    if [ "$backend" = cpu ] && podman exec "$gctr" attnctl forward --verify --dtype=bf16 \
         --heads_q=8 --heads_kv=2 --head_dim=128 --causal >"$work/gpu-image-forward.log" 2>&1; then
      pass "GPU image without a GPU: --backend=auto fell back to cpu, forward --verify OK ($(image_size "$gpu_image") on the Debian base)"
    else
      podman logs "$gctr" 2>&1 | tail -n 10
      fail "GPU image without a GPU: backend '${backend:-none}' (log: $work/gpu-image-forward.log)"
    fi
    podman logs "$gctr" 2>&1 | grep -i -m3 -E 'cuda|backend' || true
    podman stop -t 30 "$gctr" >/dev/null 2>&1
    gexit=$(podman inspect --format '{{.State.ExitCode}}' "$gctr")
    podman rm -f "$gctr" >/dev/null 2>&1 || true
    if [ "$gexit" = 0 ]; then pass "GPU image: SIGTERM exit code 0"; else fail "GPU image: SIGTERM exit code $gexit"; fi
    timed "GPU image (runtime stage) build + CPU-fallback run" "$(took "$t0")"
  fi
fi

summary
[ "$failed" -eq 0 ]
