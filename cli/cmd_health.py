"""``specmesh health HOST:PORT [--service NAME]``: exit 0 when the service reports SERVING (for
docker-compose and Kubernetes exec probes; imports no model code, so a probe is cheap)."""

from __future__ import annotations

import argparse
import sys

from specmesh.rpc.security import add_tls_args, tls_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="exit 0 when a service reports SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help='"" = alive; e.g. specmesh.v1.Target = ready')
    p.add_argument("--timeout", type=float, default=5.0)
    add_tls_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmesh.rpc.health import check_health

    ok = check_health(args.address, args.service, args.timeout, tls_from_args(args))
    print(
        f"{args.address} {args.service or '(server)'}: {'SERVING' if ok else 'NOT SERVING'}",
        file=sys.stderr,
    )
    return 0 if ok else 1
