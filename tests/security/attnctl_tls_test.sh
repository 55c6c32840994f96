#!/bin/bash
# attnctl against a secured attnserve (the real binaries): TLS with a token
# (flag and $ATTNSERVE_TOKEN), a short load run over TLS, the failures a
# missing token or a plain-text client get, and mutual TLS.
# Usage: attnctl_tls_test.sh ATTNSERVE ATTNCTL MAKE_TEST_CERTS
set -u
server_bin=$1 attnctl=$2 make_certs=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/attnctl_tls.XXXXXX")
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; [[ -f $dir/server.log ]] && tail -20 "$dir/server.log"; exit 1; }

"$make_certs" "$dir" || fail "make_test_certs"
token="attnctl-test-token-0123456789"
echo "$token attnctl-tests" >"$dir/tokens"

# Starts attnserve with extra flags and sets $port from its "listening on"
# line (evidence, not a sleep: the loop reads the log as it grows).
start() {
  "$server_bin" --host=127.0.0.1 --port=0 --metrics_port=0 --http_port=0 --backend=cpu \
    --threads=2 "$@" >"$dir/server.log" 2>&1 &
  pid=$!
  port=
  for _ in $(seq 1 1200); do
    port=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\) .*/\1/p' "$dir/server.log" | head -1)
    [[ -n $port ]] && return 0
    kill -0 "$pid" 2>/dev/null || fail "attnserve exited"
    sleep 0.1  # poll interval while reading the log
  done
  fail "attnserve never logged its port"
}
stop() { kill "$pid"; wait "$pid"; pid=; }

start --tls_cert="$dir/server.pem" --tls_key="$dir/server.key" --auth_tokens_file="$dir/tokens"
target=localhost:$port
ctl() { "$attnctl" --target="$target" --timeout=60s "$@"; }
small=(--batch=1 --seqlen_q=16 --heads_q=2 --head_dim=32 --dtype=fp32)

ctl --tls_ca="$dir/ca.pem" --wait_for_ready health | grep -q SERVING || fail "health over TLS"
ctl --tls_ca="$dir/ca.pem" --token="$token" forward "${small[@]}" --verify \
  >"$dir/out" 2>&1 || { cat "$dir/out"; fail "forward over TLS with --token"; }
ATTNSERVE_TOKEN=$token ctl --tls_ca="$dir/ca.pem" forward "${small[@]}" >"$dir/out" 2>&1 ||
  { cat "$dir/out"; fail "forward with ATTNSERVE_TOKEN"; }
ctl --tls_ca="$dir/ca.pem" forward "${small[@]}" >"$dir/out" 2>&1 && fail "no token accepted"
grep -q UNAUTHENTICATED "$dir/out" || { cat "$dir/out"; fail "no token: expected UNAUTHENTICATED"; }
ctl --token="$token" forward "${small[@]}" >"$dir/out" 2>&1 && fail "plain text accepted"
grep -q UNAVAILABLE "$dir/out" || { cat "$dir/out"; fail "plain text: expected UNAVAILABLE"; }
ctl --tls_ca="$dir/ca.pem" --token="$token" load --concurrency=2 --warmup=0s --duration=2s \
  "${small[@]}" >"$dir/out" 2>&1 || { cat "$dir/out"; fail "load over TLS"; }
stop

start --tls_cert="$dir/server.pem" --tls_key="$dir/server.key" --tls_client_ca="$dir/ca.pem"
target=localhost:$port
ctl --tls_ca="$dir/ca.pem" --tls_cert="$dir/client.pem" --tls_key="$dir/client.key" \
  --wait_for_ready forward "${small[@]}" >"$dir/out" 2>&1 || { cat "$dir/out"; fail "mutual TLS"; }
ctl --tls_ca="$dir/ca.pem" forward "${small[@]}" >"$dir/out" 2>&1 && fail "mTLS without a cert"
grep -q UNAVAILABLE "$dir/out" || { cat "$dir/out"; fail "mTLS without a cert: expected UNAVAILABLE"; }
ctl --tls_ca="$dir/ca.pem" --tls_cert="$dir/client.pem" forward "${small[@]}" >"$dir/out" 2>&1 &&
  fail "cert without key accepted"
grep -q "tls_key" "$dir/out" || { cat "$dir/out"; fail "cert without key: expected a message naming tls_key"; }
stop
echo PASS
