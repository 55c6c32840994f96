"""Command line: `python -m attnserve [--target=HOST:PORT] info|health [SERVICE]`.

info prints the server's GetServerInfo as JSON; health prints the serving
status and exits 0 only when it is SERVING. Errors print the gRPC code and the
server's message and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from google.protobuf import json_format

from attnserve.client import Client
from attnserve.errors import AttnServeError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnserve",
                                     description="Query an attnserve server.")
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GetServerInfo as JSON")
    health = sub.add_parser("health", help="grpc.health.v1 Check; exit 0 iff SERVING")
    health.add_argument("service", nargs="?", default="",
                        help='service name ("" = the whole server, or attnserve.v1.Attention)')
    args = parser.parse_args(argv)
    try:
        with Client(args.target, timeout=args.timeout, max_attempts=1) as client:
            if args.command == "info":
                info = client.info()
                print(json.dumps(json_format.MessageToDict(
                    info, preserving_proto_field_name=True), indent=2))
                return 0
            status = client.health(args.service)
            print(status)
            return 0 if status == "SERVING" else 1
    except AttnServeError as e:
        print(f"attnserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
