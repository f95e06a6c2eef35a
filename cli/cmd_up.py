"""``specmesh up``: target(s), draft and router as processes on this machine (`specmesh.cluster`);
Ctrl-C stops them. Flags for one kind of service pass through ``--target-arg`` and the like."""

from __future__ import annotations

import argparse

from specmesh.cli.serve_args import (
    HTTP_PORT,
    PORTS,
    add_http_args,
    add_model_arg,
    add_served_name_arg,
    add_tensor_parallel_arg,
)
from specmesh.protocol.config import DRAFT_KINDS
from specmesh.rpc.security import add_api_key_arg, add_tls_args

PASS_THROUGH_EXAMPLES = {
    "router": "--router-arg=--speculation=always",
    "target": "--target-arg=--dtype=bf16",
    "draft": "--draft-arg=--num-steps=3",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start target(s), draft and router here; Ctrl-C stops them")
    add_model_arg(p, "--target-model", "checkpoint dir or Hugging Face id (default: the demo)")
    add_model_arg(p, "--draft-model", "draft checkpoint dir or Hugging Face id")
    p.add_argument("--draft-kind", choices=DRAFT_KINDS)
    p.add_argument("--num-targets", type=int, default=1)
    add_tensor_parallel_arg(p)
    add_served_name_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument(
        "--port", type=int, default=PORTS["router"], help="router port (0: any free port)"
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for readiness (a Hugging Face id's first download included)",
    )
    p.add_argument(
        "--service-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for every model service that takes it (repeatable), e.g. "
        "--service-arg=--dtype=bf16 (not --metrics-port: see up's own)",
    )
    for kind, example in PASS_THROUGH_EXAMPLES.items():
        p.add_argument(
            f"--{kind}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"extra flag for the {kind} (repeatable), e.g. {example}",
        )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="N",
        help="serve the model services' Prometheus metrics on ports N, N+1, ...: target i at "
        "N+i, the draft after the last target (0 = off); the router's are always at /metrics "
        "on its HTTP port. Every address is printed once ready",
    )
    add_tls_args(p)  # one certificate for every service (serverAuth + clientAuth) and its CA
    add_api_key_arg(p, "the router's API key, handed to it in its environment")
    add_http_args(p, HTTP_PORT)
    p.add_argument("--no-http", action="store_true", help="no OpenAI-compatible HTTP API")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmesh.cluster import run_cluster

    return run_cluster(args)
