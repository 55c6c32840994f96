#!/usr/bin/env bash
# Two versions of the Python client side by side in one run, on one server:
# python_bench.py's client part (attnctl load, then the Python client, per
# point) with PYTHONPATH=BEFORE, then with PYTHONPATH=AFTER, point by point, so
# a drift in the machine's load hits both alike; every row of both goes to one
# CSV (notes = before|after), and its summary is printed last.
# BEFORE and AFTER are folders holding an installed attnserve package, e.g.
#   git archive OLD python proto | tar -x -C /tmp/old
#   .venv/bin/python -m pip install --no-deps --no-build-isolation --target /tmp/old-site /tmp/old/python
# Environment: PYTHON (default .venv/bin/python), TARGET (a running server,
# host:port), ATTNCTL (default build/client/attnctl), SECONDS_ (warm-up,measured;
# default 1,4), POINTS: space-separated scenario:rpc:concurrencies (default: the
# CPU set: Echo small and large, Forward small and mid), LABELS: the two
# versions' names in the notes column (default "before after").
# Usage: bench/gpu/python_client_ab.sh BEFORE AFTER CSV
set -euo pipefail
[ $# = 3 ] || { echo "usage: $0 BEFORE_SITE AFTER_SITE CSV" >&2; exit 2; }
before=$1 after=$2 csv=$3
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
: "${TARGET:?TARGET=host:port of a running attnserve}"
attnctl=${ATTNCTL:-build/client/attnctl}
points=${POINTS:-"small:echo:1,16 large:echo:1,4 small:forward:1,16 mid:forward:1,16"}
for point in $points; do
  IFS=: read -r scenario rpc concurrencies <<<"$point"
  for conc in ${concurrencies//,/ }; do
    read -r first second <<<"${LABELS:-before after}"
    for label in "$first" "$second"; do
      site=$before
      [ "$label" = "$second" ] && site=$after
      echo "== $scenario $rpc concurrency $conc: $label ($site)"
      env -u PYTHONPATH PYTHONPATH="$site" "$py" bench/gpu/python_bench.py --target="$TARGET" \
        --attnctl="$attnctl" --csv="$csv" --parts=client --scenarios="$scenario" --rpcs="$rpc" \
        --concurrency="$conc" --seconds="${SECONDS_:-1,4}" --label="$label" | grep '^part='
    done
  done
done
PYTHONPATH=$after "$py" -c 'import sys; sys.path.insert(0, "bench/gpu"); import python_bench as b; b.print_summary(sys.argv[1])' "$csv"
