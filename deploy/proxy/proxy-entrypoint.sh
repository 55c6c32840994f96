#!/bin/sh
# Writes the affinity proxy's nginx.conf from the environment and runs nginx
# in the foreground as PID 1.
#   ATTNSERVE_PROXY_UPSTREAMS  replicas, "host:port host:port ..." (required);
#                              a DNS name with several addresses (a Kubernetes
#                              headless Service) becomes one server each,
#                              resolved when nginx starts
#   ATTNSERVE_PROXY_PORT       port to listen on (default 50051)
#   ATTNSERVE_PROXY_MAX_BODY   largest request body (default 1100m: above the
#                              server's 1 GiB limit, so the server answers)
#   ATTNSERVE_PROXY_FAIL_TIMEOUT  how long a replica that failed a connection
#                              is skipped (default 5s); a restarted replica gets
#                              its caches' calls back after it
set -eu
: "${ATTNSERVE_PROXY_UPSTREAMS:?set ATTNSERVE_PROXY_UPSTREAMS to the replicas, e.g. 'attnserve-1:50051 attnserve-2:50051'}"
port=${ATTNSERVE_PROXY_PORT:-50051}
max_body=${ATTNSERVE_PROXY_MAX_BODY:-1100m}
fail_timeout=${ATTNSERVE_PROXY_FAIL_TIMEOUT:-5s}
template=${ATTNSERVE_PROXY_TEMPLATE:-/etc/attnserve-proxy/nginx.conf.template}
conf=${ATTNSERVE_PROXY_CONF:-/tmp/attnserve-proxy.conf}
servers=""
for u in $ATTNSERVE_PROXY_UPSTREAMS; do
  servers="${servers}    server ${u} max_fails=1 fail_timeout=${fail_timeout};\n"
done
# shellcheck disable=SC2059  # the \n in $servers are meant for printf
printf "$servers" >"$conf.servers"
sed -e "/^@UPSTREAM_SERVERS@$/{r $conf.servers" -e 'd}' \
    -e "s/@LISTEN_PORT@/$port/" -e "s/@MAX_BODY@/$max_body/" "$template" >"$conf"
rm -f "$conf.servers"
exec nginx -c "$conf" -g 'daemon off;'
