#!/usr/bin/env bash
# Makes (or updates) one of the project's Python environments from the pinned
# lists in requirements/, so tests that use Python clients run the same on
# every machine. Each SET is a venv of its own, because the clients pin
# incompatible versions (tritonclient 2.50 needs protobuf < 5, the attnserve
# package's generated stubs protobuf >= 7.35):
#   python  .venv         requirements/python-*.txt (attnserve package, transformers)
#   triton  .venv-triton  requirements/triton*.txt  (tritonclient, perf_analyzer)
# No pip cache: the CUDA-bundled torch wheel would be kept twice (a CI machine ran
# out of disk there).
# Prints the interpreter's path last.
# Usage: scripts/python-env.sh [SET]   (default: python)
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=${1:-python}
case "$set_name" in
  python) venv=.venv ;;
  *) venv=.venv-$set_name ;;
esac
shopt -s nullglob
req_files=(requirements/"$set_name"*.txt)
[ ${#req_files[@]} -gt 0 ] || { echo "python-env: no requirements/$set_name*.txt" >&2; exit 2; }
python=${PYTHON:-python3}
if ! "$python" -m venv --help >/dev/null 2>&1; then
  echo "python-env: $python has no venv module (apt-get install python3-venv)" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.requirements.sha256"
want=$(cat "${req_files[@]}" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  start=$(date +%s)
  "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip
  for r in "${req_files[@]}"; do
    echo "python-env: installing $r" >&2
    "$venv/bin/python" -m pip install -q --no-cache-dir -r "$r"
  done
  echo "$want" >"$stamp"
  echo "python-env: took $(( $(date +%s) - start )) s" >&2
fi
echo "$(pwd)/$venv/bin/python"
