#!/usr/bin/env bash
# Checks C++/CUDA formatting against .clang-format (clang-format --dry-run
# -Werror). With file arguments, checks those; without, every tracked
# .h/.cc/.cu/.cuh file except the ones listed in UNCHECKED below.
# --fix formats in place instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."

# Not checked (yet): files other work streams were rewriting when the
# formatter arrived; drop entries here once they are formatted.
UNCHECKED='^(backend/cuda/attn_fwd_kernel\.cuh|server/kv/|server/kserve/|python/|client/cli/load.*\.cc)'

fix=0
if [[ "${1:-}" == "--fix" ]]; then
  fix=1
  shift
fi
if [[ $# -gt 0 ]]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | grep -Ev "$UNCHECKED" || true)
fi
[[ ${#files[@]} -gt 0 ]] || exit 0
if [[ $fix -eq 1 ]]; then
  clang-format -i "${files[@]}"
else
  clang-format --dry-run -Werror "${files[@]}"
  echo "check-format: ${#files[@]} files formatted"
fi
