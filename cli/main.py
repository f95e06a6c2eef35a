"""The `specmesh` command: one subcommand per module, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module (relative to the `specmesh` package) that defines add_parser(sub) / run(args)
COMMANDS = {
    "generate": "specmesh.cli.cmd_generate",
    "make-tiny": "specmesh.cli.cmd_models",
    "make-demo": "specmesh.cli.cmd_models",
    "target": "specmesh.cli.cmd_serve",
    "draft": "specmesh.cli.cmd_serve",
    "router": "specmesh.cli.cmd_serve",
    "up": "specmesh.cli.cmd_up",
    "health": "specmesh.cli.cmd_health",
    "bench": "specmesh.cli.cmd_bench",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only ``command``'s module when it is known (so a health probe
    does not import the model stack)."""
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="Python logging level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    seen: set[str] = set()
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module_name in dict.fromkeys(modules):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # a subcommand module not written yet
        module.add_parser(sub)
        seen.update(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"specmesh {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
