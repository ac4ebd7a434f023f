"""The `vllm-mamba` command: `serve`, `generate`, `bench`, `chat` and `models` subcommands.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
its arguments and sets `func` to run it and `parser` to itself (so that an unknown flag is
reported with that subcommand's usage). Engine flags come from `EngineArgs`. Building a
parser imports no torch, transformers or engine: a subcommand's `--help` or a mistyped flag
answers as fast as `vllm-mamba --help`.

Every subcommand fails the same way: `error: ...` on standard error, exit status 2 for what
the command line gave (a flag, a value, a model that is not there), 1 for a failure while
running.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vllm_mamba.entrypoints.cli_args import RUNTIME_ERROR, USAGE_ERROR, Parser, print_error

_SUBCOMMANDS = {
    "serve": ("vllm_mamba.entrypoints.openai.cli_serve", "start an OpenAI-compatible HTTP server"),
    "generate": ("vllm_mamba.entrypoints.generate", "generate continuations of prompts"),
    "bench": ("vllm_mamba.entrypoints.bench", "benchmark latency or throughput"),
    "chat": ("vllm_mamba.entrypoints.chat_cli", "chat with a model in the terminal"),
    "models": (
        "vllm_mamba.entrypoints.models_cli",
        "list the shipped models and the supported models in the hub cache",
    ),
}
_ALL = object()


def build_parser(command: str | None | object = _ALL) -> argparse.ArgumentParser:
    """The top-level parser. Every subcommand's module is imported only for the subcommand
    being run (`command`; by default all of them): `vllm-mamba --help` and `--version` load
    no engine (and no torch), the others show their name and one line."""
    from vllm_mamba import __version__

    parser = Parser(
        prog="vllm-mamba",
        description="Inference and serving engine for state-space language models (Mamba).",
    )
    parser.add_argument("--version", action="version", version=f"vllm-mamba {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for name, (module_name, summary) in _SUBCOMMANDS.items():
        if command is _ALL or command == name:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` runs: its first word that is not a flag (None: none)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in _SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script (Ctrl-C exits with 130, without a traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(_command_of(argv))
        args, extra = parser.parse_known_args(argv)
        into = getattr(args, "more_positionals", None)
        if into:  # words after a flag still belong to a nargs="*" positional (`generate`)
            getattr(args, into).extend(a for a in extra if a == "-" or not a.startswith("-"))
            extra = [a for a in extra if a != "-" and a.startswith("-")]
        if extra:
            # Report unknown flags with the usage of the subcommand they were given to.
            owner = getattr(args, "parser", None) or parser
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return _run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    """Runs the parsed subcommand; its errors become one `error: ...` line."""
    from vllm_mamba.errors import STARTUP_ERRORS, EngineDeadError, RequestsFailedError

    try:
        return int(args.func(args) or 0)
    except STARTUP_ERRORS as err:  # an option, a value or a model that cannot be used
        print_error(err)
        return USAGE_ERROR
    except (EngineDeadError, RequestsFailedError, OSError) as err:
        print_error(err)
        return RUNTIME_ERROR


if __name__ == "__main__":
    sys.exit(main())
