"""What the `vllm-mamba` subcommands share on their command lines: the parser (no abbreviated
flags, errors as `error: ...`), the help formatter (one default per flag, never `None`), the
model argument, given as `MODEL` or `--model MODEL`, and which words name a model.

Light on purpose: no torch, so that `vllm-mamba --help` and every subcommand's stay fast.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn

USAGE_ERROR = 2  # exit status: what the command line gave cannot be used
RUNTIME_ERROR = 1  # exit status: it failed while running
_NAME_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)+/?$")  # owner/name, models/mamba/130m
_PATH_START = re.compile(r"^(\.{1,2}/|~$|~[\w.-]*/|/[\w.~-])")  # ./ ../ ~/ ~user/ /abs
_GIVEN = "_model_given"  # on the namespace: the model as the command line gave it


def print_error(message: object) -> None:
    """Every subcommand's error line: `error: MESSAGE` on standard error."""
    print(f"error: {message}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """The parser of `vllm-mamba` and of each subcommand (argparse makes its subparsers of
    this class): a flag is taken only as written in full (`--max-token` is not
    `--max-tokens`), and a usage error prints the usage, then `error: ...`, and exits 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print_error(message)
        sys.exit(USAGE_ERROR)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default once: not when its help already says it ("default"), and
    never an empty one (None, False, "", []); keeps the examples' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == ""
            or default == []
        ):
            return text
        return super()._get_help_string(action)


class _ModelAction(argparse.Action):
    """Stores the model; the same model given both as `MODEL` and `--model` is fine, two
    different ones are an error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, _GIVEN, None)
        if given is not None and given != values:
            parser.error(f"two different models: {given!r} and {values!r} (give MODEL or --model)")
        setattr(namespace, _GIVEN, values)
        namespace.model = values


def add_model_args(parser: argparse.ArgumentParser, default: str, positional: bool = True) -> None:
    """`MODEL` (optional positional, when `positional`) and `--model MODEL`, both into
    `args.model`; `default` when neither is given."""
    text = "a local Hugging Face model directory, a GGUF file, a shipped name or a hub id"
    if positional:
        parser.add_argument(
            "model", nargs="?", default=argparse.SUPPRESS, action=_ModelAction, metavar="MODEL",
            help=f"{text} (default: {default})",
        )  # fmt: skip
        text = "the model, as a flag (vLLM's form)"
    else:
        text += f" (default: {default})"
    parser.add_argument("--model", default=default, action=_ModelAction, help=text)


def names_a_model(word: str) -> bool:
    """Whether a command-line word is meant as a model rather than as a prompt: an existing
    directory, or a word shaped as a path or a model name, existing or not (then loading it
    is an error, never a prompt):

    - a path: `./x`, `../x`, `/x`, `~/x`, `~user/x`, or a word ending with `/`;
    - `owner/name` (a shipped name `vllm-mamba/NAME` or a hub id) or `dir/dir/name`: name
      characters only, no spaces.

    Source code stays a prompt: `def f(x):`, `import os.path`, `#!/bin/sh`, `/** doc */`,
    `a / b`, `~x`, and anything on several lines.
    """
    if "\n" in word:
        return False
    return (
        os.path.isdir(word)
        or bool(_PATH_START.match(word))
        or (word.endswith(("/", os.sep)) and not any(c.isspace() for c in word))
        or bool(_NAME_PATH.match(word))
    )


def add_verbose_arg(parser: Any) -> None:
    """`-v/--verbose` of the terminal commands, which log warnings and errors only without it
    (to standard error, never inside the model's text)."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at info level too (set-up, threads)"
    )
