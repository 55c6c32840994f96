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

# Each variable, when set and not empty, becomes one flag. Flags from the
# command line come after these, so they take precedence.
set -- \
  ${ATTNSERVE_HOST:+"--host=$ATTNSERVE_HOST"} \
  ${ATTNSERVE_PORT:+"--port=$ATTNSERVE_PORT"} \
  ${ATTNSERVE_BACKEND:+"--backend=$ATTNSERVE_BACKEND"} \
  ${ATTNSERVE_THREADS:+"--threads=$ATTNSERVE_THREADS"} \
  ${ATTNSERVE_DEVICES:+"--devices=$ATTNSERVE_DEVICES"} \
  ${ATTNSERVE_MAX_REQUEST_BYTES:+"--max_request_bytes=$ATTNSERVE_MAX_REQUEST_BYTES"} \
  ${ATTNSERVE_MAX_TOKENS:+"--max_tokens=$ATTNSERVE_MAX_TOKENS"} \
  ${ATTNSERVE_MAX_QUEUE_SIZE:+"--max_queue_size=$ATTNSERVE_MAX_QUEUE_SIZE"} \
  ${ATTNSERVE_BATCHING:+"--batching=$ATTNSERVE_BATCHING"} \
  ${ATTNSERVE_BATCH_MAX_DELAY_US:+"--batch_max_delay_us=$ATTNSERVE_BATCH_MAX_DELAY_US"} \
  ${ATTNSERVE_BATCH_MAX_TOKENS:+"--batch_max_tokens=$ATTNSERVE_BATCH_MAX_TOKENS"} \
  ${ATTNSERVE_METRICS_HOST:+"--metrics_host=$ATTNSERVE_METRICS_HOST"} \
  ${ATTNSERVE_METRICS_PORT:+"--metrics_port=$ATTNSERVE_METRICS_PORT"} \
  ${ATTNSERVE_SHUTDOWN_GRACE:+"--shutdown_grace=$ATTNSERVE_SHUTDOWN_GRACE"} \
  ${ATTNSERVE_LOG_LEVEL:+"--log_level=$ATTNSERVE_LOG_LEVEL"} \
  ${ATTNSERVE_TLS_CERT:+"--tls_cert=$ATTNSERVE_TLS_CERT"} \
  ${ATTNSERVE_TLS_KEY:+"--tls_key=$ATTNSERVE_TLS_KEY"} \
  ${ATTNSERVE_TLS_CLIENT_CA:+"--tls_client_ca=$ATTNSERVE_TLS_CLIENT_CA"} \
  ${ATTNSERVE_AUTH_TOKENS_FILE:+"--auth_tokens_file=$ATTNSERVE_AUTH_TOKENS_FILE"} \
  "$@"

exec /usr/local/bin/attnserve "$@"
