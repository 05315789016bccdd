"""`mtpserve` command line: one sub-command module per verb."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "serve": "mtpserve.cluster.cli.cmd_serve",
    "generate": "mtpserve.cluster.cli.cmd_generate",
    "bench": "mtpserve.cluster.cli.cmd_bench",
    "train-draft": "mtpserve.cluster.cli.cmd_train",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every available sub-command, or with `command` alone when it names one (the
    others' modules, the benchmarks' model stack among them, are then not imported)."""
    parser = argparse.ArgumentParser(
        prog="mtpserve",
        description="Speculative-decoding LLM service: a tensor-parallel target plus an MTP Eagle draft head.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = {command: COMMANDS[command]} if command in COMMANDS else COMMANDS
    for name, module in chosen.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mtpserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    args.argv = argv
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
