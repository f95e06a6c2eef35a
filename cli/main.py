"""The `specmesh` command."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("specmesh", argv or sys.argv[1:])
    return 0
