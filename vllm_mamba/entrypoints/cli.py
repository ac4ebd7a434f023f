"""The `vllm-mamba` command: `serve`, `generate`, `bench`, `chat` and `models` subcommands.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
its arguments and sets `func` to run it and `parser` to itself (so that an unknown flag is
reported with that subcommand's usage). Engine flags come from `EngineArgs`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "serve": "vllm_mamba.entrypoints.openai.cli_serve",
    "generate": "vllm_mamba.entrypoints.generate",
    "bench": "vllm_mamba.entrypoints.bench",
    "chat": "vllm_mamba.entrypoints.chat_cli",
    "models": "vllm_mamba.entrypoints.models_cli",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    from vllm_mamba import __version__

    parser = argparse.ArgumentParser(
        prog="vllm-mamba",
        description="Inference and serving engine for state-space language models (Mamba).",
    )
    parser.add_argument("--version", action="version", version=f"vllm-mamba {__version__}")
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
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Report unknown flags with the usage of the subcommand they were given to.
        owner = getattr(args, "parser", None) or parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
