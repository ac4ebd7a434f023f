"""What the `vllm-mamba` subcommands share on their command lines: the help formatter (one
default per flag, never `None`) and the model argument, given as `MODEL` or `--model MODEL`.

Light on purpose: no torch, so that `vllm-mamba --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_GIVEN = "_model_given"  # on the namespace: the model as the command line gave it


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


def add_model_args(
    parser: argparse.ArgumentParser, default: str | None, positional: bool = True
) -> None:
    """`MODEL` (optional positional, when `positional`) and `--model MODEL`, both into
    `args.model`; `default` when neither is given (None: required, see `require_model`)."""
    text = "a local Hugging Face model directory, a shipped name or a hub id"
    if positional:
        parser.add_argument(
            "model", nargs="?", default=argparse.SUPPRESS, action=_ModelAction, metavar="MODEL",
            help=text + (f" (default: {default})" if default else ""),
        )  # fmt: skip
        text = "the model, as a flag (vLLM's form)"
    elif default:
        text += f" (default: {default})"
    parser.add_argument("--model", default=default, action=_ModelAction, help=text)


def require_model(args: argparse.Namespace) -> str:
    """The model of parsed `args`; exits with the subcommand's usage when there is none."""
    if not getattr(args, "model", None):
        parser = getattr(args, "parser", None)
        if parser is None:
            raise SystemExit("error: a model is required (MODEL or --model MODEL)")
        parser.error("a model is required: MODEL or --model MODEL")
    return args.model


def names_a_model(word: str) -> bool:
    """Whether a command-line word names a model rather than being a prompt: an existing
    directory, a shipped name (`vllm-mamba/NAME`) or a hub id (`owner/name`, no spaces)."""
    return os.path.isdir(word) or bool(_HUB_ID.match(word))
