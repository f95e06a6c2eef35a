"""``specmesh health HOST:PORT [--service NAME]``: exit 0 when the service reports SERVING (for
docker-compose and Kubernetes exec probes; imports no model code, so a probe is cheap). Prints
the status the server gave; exit 3 when the server does not know the service name (NOT_FOUND:
SERVICE_UNKNOWN, a misconfigured probe), else 1 (NOT_SERVING, UNAVAILABLE, ...)."""

from __future__ import annotations

import argparse
import sys

from specmesh.rpc.security import add_tls_args, tls_from_args

EXIT_CODES = {"SERVING": 0, "SERVICE_UNKNOWN": 3}  # anything else: 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="exit 0 when a service reports SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help='"" = alive; e.g. specmesh.v1.Target = ready')
    p.add_argument("--timeout", type=float, default=5.0)
    add_tls_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmesh.rpc.health import health_status

    status = health_status(args.address, args.service, args.timeout, tls_from_args(args))
    print(f"{args.address} {args.service or '(server)'}: {status}", file=sys.stderr)
    return EXIT_CODES.get(status, 1)
