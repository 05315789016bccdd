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


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available sub-command."""
    parser = argparse.ArgumentParser(
        prog="mtpserve",
        description="Speculative-decoding LLM service: a tensor-parallel target plus an MTP Eagle draft head.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
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
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
