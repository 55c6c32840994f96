#!/usr/bin/env bash
# Checks C++/CUDA formatting against .clang-format (clang-format --dry-run
# -Werror). With file arguments, checks those; without, every tracked
# .h/.cc/.cu/.cuh file, backend/cuda/generated/ included (committed output of
# backend/cuda/generate_kernels.py, so held to the same format).
# --fix formats in place instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."

fix=0
if [[ "${1:-}" == "--fix" ]]; then
  fix=1
  shift
fi
if [[ $# -gt 0 ]]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
fi
[[ ${#files[@]} -gt 0 ]] || exit 0
# The version scripts/install-deps.sh installs: another version formats differently.
formatter=clang-format-14
command -v "$formatter" >/dev/null || { echo "check-format: $formatter not found (scripts/install-deps.sh)" >&2; exit 1; }
if [[ $fix -eq 1 ]]; then
  "$formatter" -i "${files[@]}"
else
  "$formatter" --dry-run -Werror "${files[@]}"
  echo "check-format: ${#files[@]} files formatted"
fi
