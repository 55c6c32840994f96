#!/bin/sh
# Entry point of the attnserve images: turns ATTNSERVE_* environment variables
# into attnserve flags, then execs the server so that it becomes PID 1 and
# receives SIGTERM itself (docker stop, podman stop, a Kubernetes pod deletion).
# attnserve installs its own SIGTERM/SIGINT handler (drain, then exit 0), which
# is what PID 1 needs: the kernel drops signals that PID 1 has no handler for.
# attnserve starts no child processes, so there are no zombies to reap and no
# init (tini, --init) is needed.
#
#   docker run IMAGE                         attnserve, configured from ATTNSERVE_*
#   docker run IMAGE --backend=cpu --port=7000
#                                            flags after the image name are appended
#                                            (a flag given twice: the last one wins)
#   docker run IMAGE attnctl health          anything that is not a flag runs as is
set -eu

if [ $# -gt 0 ]; then
  case "$1" in
    -*) ;;                # flags for attnserve
    attnserve) shift ;;   # "IMAGE attnserve --flag" works too
    *) exec "$@" ;;       # attnctl, sh, ...
  esac
fi

# Every server flag --NAME has the variable ATTNSERVE_<NAME in capitals>;
# deploy/validate.sh checks this list against server/main.cc's flags. Each
# variable, when set and not empty, becomes one flag. They are put before the
# command line's flags, so those take precedence.
flags="
host port backend threads devices cpu_devices
max_request_bytes max_buffered_bytes max_tokens max_queue_size launch_timeout inline_max_cost
batching batch_max_delay_us batch_max_tokens batch_invariant
metrics_host metrics_port http_port allow_client_shm max_shm_regions max_shm_regions_per_tenant
stream_max_pending_requests stream_max_pending_bytes max_streams_per_tenant
kv_cache_bytes kv_page_size kv_idle_timeout kv_startup_cache kv_import_idle_timeout ucx_port ucx_host
tls_cert tls_key tls_client_ca tls_reload_interval auth_tokens_file auth_reload_interval
handoff_peer handoff_peer_ca handoff_linger handoff_transport
shutdown_grace log_level
"
# Reversed, so that prepending each keeps the list's order.
reversed=
for name in $flags; do reversed="$name $reversed"; done
for name in $reversed; do
  var=ATTNSERVE_$(printf '%s' "$name" | tr '[:lower:]' '[:upper:]')
  eval "value=\${$var:-}"
  if [ -n "$value" ]; then set -- "--$name=$value" "$@"; fi
done

exec /usr/local/bin/attnserve "$@"
