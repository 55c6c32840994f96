#!/usr/bin/env bash
# Installs what attnserve needs to build and test on Debian 12, skipping what
# is already present. The CUDA toolkit is optional and never installed here:
# when /usr/local/cuda/bin/nvcc exists the CUDA backend is built too.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libcpp-httplib-dev nlohmann-json3-dev
  libssl-dev zlib1g-dev libc-ares-dev libre2-dev
  # The UCX step transport (docs/ucx.md; optional at configure time: cmake/ucx.cmake).
  libucx-dev
  # perf_analyzer (inside the tritonclient wheel, requirements/triton.txt) links libb64.
  libb64-0d python3-venv
  # scripts/check-format.sh: one formatter version, so CI and developers agree.
  clang-format-14
  # The affinity proxy (deploy/proxy, the package its image installs): ctest's
  # rolling_restart_demo_nginx runs it as this user with its own config; the
  # package's own service (port 80) is not used.
  nginx
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
