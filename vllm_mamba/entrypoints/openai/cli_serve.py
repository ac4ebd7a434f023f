"""The server's command-line flags and the `vllm-mamba serve MODEL` subcommand.

`add_server_args` is shared with `python -m vllm_mamba.entrypoints.openai.api_server
--model MODEL`. The server itself is imported only when the command runs, so building the
`vllm-mamba` parser stays cheap.
"""

from __future__ import annotations

import argparse
from typing import Any

API_KEY_ENV = "VLLM_MAMBA_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already explains it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every server flag except the model to `parser`."""
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: the model argument)",
    )
    net.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, or none)",
    )
    net.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="logging level")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--tokenizer", default=None, help="tokenizer (default: the model)")
    eng.add_argument("--max-num-seqs", type=int, default=256, help="sequences in flight (slots)")
    eng.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step"
    )
    eng.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus output (default: from the model config, else 2048)",
    )
    eng.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16", "half"),
        help="weights and activations dtype (auto: the config's, else float32)",
    )
    eng.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA if present"
    )
    eng.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    eng.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from vllm_mamba.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `serve MODEL` on the `vllm-mamba` command."""
    parser = subparsers.add_parser(
        "serve",
        help="start an OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("model", help="a local Hugging Face model directory or a hub id")
    add_server_args(parser)
    parser.set_defaults(func=_serve)
    return parser
