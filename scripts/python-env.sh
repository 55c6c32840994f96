#!/usr/bin/env bash
# Makes (or updates) the project's Python environment at .venv from the pinned
# lists in requirements/*.txt, so tests that use Python clients (the attnserve
# package, tritonclient, perf_analyzer, transformers) run the same on every
# machine. Prints the interpreter's path last.
# Usage: scripts/python-env.sh [VENV_DIR]   (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3}
if ! "$python" -m venv --help >/dev/null 2>&1; then
  echo "python-env: $python has no venv module (apt-get install python3-venv)" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.requirements.sha256"
want=$(cat requirements/*.txt 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  start=$(date +%s)
  "$venv/bin/python" -m pip install -q --upgrade pip
  for r in requirements/*.txt; do
    [ -e "$r" ] || continue
    echo "python-env: installing $r" >&2
    "$venv/bin/python" -m pip install -q -r "$r"
  done
  echo "$want" >"$stamp"
  echo "python-env: took $(( $(date +%s) - start )) s" >&2
fi
echo "$(pwd)/$venv/bin/python"
