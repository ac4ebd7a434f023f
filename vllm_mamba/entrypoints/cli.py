"""The `vllm-mamba` command: `serve`, `generate` and `bench` subcommands.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
its arguments and sets `func` to run it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "serve": "vllm_mamba.entrypoints.openai.cli_serve",
    "generate": "vllm_mamba.entrypoints.generate",
    "bench": "vllm_mamba.entrypoints.bench",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="vllm-mamba",
        description="Inference and serving engine for state-space language models (Mamba).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for module_name in _SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
