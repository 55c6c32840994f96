"""Channel options shared by Client and AsyncClient: message limits and retries.

Retries: gRPC's own retry policy (a service config), only for UNAVAILABLE (no
server reachable, or one draining for shutdown). Every attnserve.v1.Attention
call is stateless, so a retried Forward cannot be applied twice; gRPC retries a
stream only before any response came back. Calls that change server state (the
K/V API) must name their own policy: an append carries the sequence length it
expects, so a duplicate is refused (FAILED_PRECONDITION) instead of applied.
"""

from __future__ import annotations

import json
from typing import Iterable, List, Optional, Sequence, Tuple

ChannelOptions = Sequence[Tuple[str, object]]

# A request of the large benchmark scenario is ~200 MB; the server's own limit
# (--max_request_bytes, 1 GiB by default) is the one that should refuse.
DEFAULT_MAX_MESSAGE_BYTES = (1 << 31) - 1
DEFAULT_TIMEOUT_S = 60.0


def service_config(services: Iterable[str], max_attempts: int) -> str:
    """A gRPC service config retrying UNAVAILABLE up to max_attempts tries in all."""
    if max_attempts < 2:
        return json.dumps({"methodConfig": []})
    return json.dumps({"methodConfig": [{
        "name": [{"service": s} for s in services],
        "retryPolicy": {
            "maxAttempts": min(max_attempts, 5),  # gRPC caps it at 5
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]})


def channel_options(options: Optional[ChannelOptions], max_attempts: int,
                    max_message_bytes: int) -> List[Tuple[str, object]]:
    """Our defaults, then the caller's options (which win on the same key)."""
    ours = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.enable_retries": 1 if max_attempts >= 2 else 0,
        # gRPC keeps a request this large for a retry (default 256 KiB); a
        # larger one is sent once, and its UNAVAILABLE reaches the caller.
        "grpc.per_rpc_retry_buffer_size": 64 << 20,
        "grpc.service_config": service_config(
            ["attnserve.v1.Attention", "grpc.health.v1.Health"], max_attempts),
    }
    for key, value in options or ():
        ours[key] = value
    return list(ours.items())
