"""Which of ``specmesh up``'s pass-through flags go to which child.

``--router-arg``, ``--target-arg`` and ``--draft-arg`` hand a flag to one kind of service;
``--service-arg`` to every model service (targets and draft) that takes it. Each flag is looked
up in the real parser of the service it goes to before anything starts, so a flag no service
takes is refused by name instead of killing a child at start. A value may follow its flag as
its own argument (``--target-arg=--dtype --target-arg=bf16``) or after ``=``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import cache

MODEL_SERVICES = ("target", "draft")
# Flags `up` sets on its children itself: passing them through would fight its own choice.
OWNED = {
    "target": ("--host", "--port", "--model", "--revision"),
    "draft": ("--host", "--port", "--model", "--revision", "--target-model", "--target-revision"),
    "router": ("--host", "--port", "--target", "--draft", "--http-port"),
}


@dataclass
class ChildFlags:
    """Extra flags per service kind, in the order given."""

    by_kind: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in OWNED})


@cache
def _options(kind: str) -> frozenset[str]:
    from specmesh.cli.main import build_parser

    parser = build_parser(kind)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(sub.choices[kind]._option_string_actions)


def _groups(args: list[str]) -> list[list[str]]:
    """``args`` cut into flags, each with the values that follow it."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("-") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def _takers(flag: str, kinds: tuple[str, ...], origin: str) -> list[str]:
    name = flag.split("=", 1)[0]
    if not name.startswith("-"):
        raise ValueError(f"{origin} {flag!r}: a value with no flag before it")
    owned = [k for k in kinds if name in OWNED[k]]
    if owned:
        raise ValueError(f"{origin} {name}: `specmesh up` sets it for the {owned[0]} itself")
    takers = [k for k in kinds if name in _options(k)]
    if not takers:
        raise ValueError(f"{origin} {name}: no {' or '.join(kinds)} takes this flag")
    return takers


def route(router: list[str], target: list[str], draft: list[str], service: list[str],
          with_draft: bool) -> ChildFlags:  # fmt: skip
    """Check every pass-through flag against its services' parsers and sort them by kind."""
    out = ChildFlags()
    sources = [
        ("--router-arg", router, ("router",)),
        ("--target-arg", target, ("target",)),
        ("--draft-arg", draft, ("draft",)),
        ("--service-arg", service, MODEL_SERVICES if with_draft else ("target",)),
    ]
    for origin, args, kinds in sources:
        if origin == "--draft-arg" and args and not with_draft:
            raise ValueError("--draft-arg: this cluster has no draft")
        for group in _groups(args):
            for kind in _takers(group[0], kinds, origin):
                out.by_kind[kind] += group
    return out
