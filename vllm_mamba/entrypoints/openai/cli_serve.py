"""The server's command-line flags and the `vllm-mamba serve MODEL` subcommand.

`add_server_args` (the server's own flags, then every `EngineArgs` flag) is shared with
`python -m vllm_mamba.entrypoints.openai.api_server --model MODEL`. The server itself is
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import ssl
from typing import Any

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.entrypoints.cli_args import (  # noqa: F401 - HelpFormatter for api_server
    HelpFormatter,
    add_model_args,
)
from vllm_mamba.model_zoo import DEFAULT_MODEL

API_KEY_ENV = "VLLM_MAMBA_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 3.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 256
DEFAULT_UNCAPPED_CLIENTS = "127.0.0.0/8,::1"
DEFAULT_STREAM_STALL_TIMEOUT_S = 30.0
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
DEFAULT_GRAMMAR_COMPILE_WORKERS = 2
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


EXAMPLES = """examples:
  vllm-mamba serve --port 8000                          # the shipped model, offline
  curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
      -d '{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'
  vllm-mamba serve state-spaces/mamba-130m-hf --dtype bfloat16 --api-key KEY
  vllm-mamba serve MODEL --chat-template template.jinja --max-num-seqs 64
"""


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every server flag and every `EngineArgs` flag except the model to `parser`."""
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument(
        "--fd",
        type=int,
        default=None,
        metavar="FD",
        help="serve on the listening TCP socket inherited as file descriptor FD (from a "
        "supervisor, systemd socket activation or a test harness) instead of binding "
        "--host/--port",
    )
    net.add_argument(
        "--api-key",
        default=None,
        help=(
            "require `Authorization: Bearer KEY` on /v1/* and on /tokenize with chat messages "
            f"(default: ${API_KEY_ENV}, or none)"
        ),
    )
    net.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="logging level")
    net.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=LOG_LEVELS,
        help="uvicorn's logging level (default: --log-level)",
    )
    net.add_argument(
        "--chat-template",
        default=None,
        help="chat template, a file or the template text (default: the tokenizer's)",
    )
    net.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template sent in a request (rendered in a bounded sandbox)",
    )
    logs = net.add_mutually_exclusive_group()
    logs.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        help="log every request's prompt and parameters",
    )
    logs.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log requests (the default)",
    )
    net.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger ones get HTTP 413",
    )
    net.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the web chat page at / (then / is a 404)",
    )
    _add_connection_args(net)
    _add_tls_cors_args(parser)
    _add_parser_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


def json_str_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings, such as `'["https://app.example"]'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"not JSON ({err.msg}): give a JSON list of strings, e.g. '[\"*\"]'"
        ) from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return value


def _add_tls_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's TLS (uvicorn's ssl_* settings) and CORS (Starlette's CORSMiddleware) flags."""
    tls = parser.add_argument_group("TLS")
    tls.add_argument("--ssl-keyfile", default=None, help="serve https: the private key (PEM)")
    tls.add_argument(
        "--ssl-certfile", default=None, help="serve https: the certificate chain (PEM)"
    )
    tls.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates that verify client certificates"
    )
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=(int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)),
        help="client certificates: 0 not asked for (the default), 1 optional, 2 required "
        "(Python's ssl.CERT_*)",
    )
    cors = parser.add_argument_group("CORS")
    cors.add_argument(
        "--allowed-origins",
        type=json_str_list,
        default=["*"],
        help="origins browsers may call from, a JSON list (default: '[\"*\"]')",
    )
    cors.add_argument(
        "--allowed-methods",
        type=json_str_list,
        default=["*"],
        help="methods allowed cross-origin, a JSON list (default: '[\"*\"]')",
    )
    cors.add_argument(
        "--allowed-headers",
        type=json_str_list,
        default=["*"],
        help="request headers allowed cross-origin, a JSON list (default: '[\"*\"]')",
    )
    cors.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow cross-origin requests with credentials (cookies, Authorization)",
    )


def _add_parser_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for reading tool calls and reasoning out of the generated text."""
    group = parser.add_argument_group("tool calls and reasoning")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of the output (tool_choice "auto"); needs --tool-call-parser',
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        help="the model's tool-call format: hermes, qwen3_coder, llama3_json, pythonic, "
        "granite, nemotron_json, ... (vLLM's names)",
    )
    group.add_argument(
        "--tool-parser-plugin",
        default=None,
        help="a Python file that registers more tool-call parsers (ToolParserManager.register)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        help="split the reasoning part into the message's `reasoning` field: qwen3, "
        "deepseek_r1, granite, nemotron_v3, ... (vLLM's names)",
    )


def _add_connection_args(net: Any) -> None:
    """The flags that bound what one client can hold: connections, slow reads, compiles."""
    net.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open",
    )
    net.add_argument(
        "--first-byte-timeout",
        type=float,
        default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
        help="seconds a new connection may take to send its first byte (then 408, closed)",
    )
    net.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take after their first byte (then 408, closed)",
    )
    net.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take after its headers (then 408, closed)",
    )
    net.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at once: a new one closes the one that has waited longest "
        "without a request in flight, or, when all have one, gets a 503",
    )
    net.add_argument(
        "--max-connections-per-client",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        help="open connections from one client address (an IPv6 client's /64), made room "
        "for as --max-connections",
    )
    net.add_argument(
        "--uncapped-clients",
        type=parse_networks,
        default=parse_networks(DEFAULT_UNCAPPED_CLIENTS),
        metavar="CIDRS",
        help="comma-separated addresses or networks exempt from --max-connections-per-client "
        "(a local reverse proxy or benchmark stands for many clients; '' for none)",
    )
    net.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=DEFAULT_STREAM_STALL_TIMEOUT_S,
        help="seconds a client may leave its output unread before it is aborted (0: never)",
    )
    net.add_argument(
        "--max-slots-per-request",
        type=int,
        default=None,
        help="sequences (n times prompts) one request may run (default: max_num_seqs / 2)",
    )
    net.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds one structured-output grammar may compile (then 400)",
    )
    net.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=DEFAULT_GRAMMAR_COMPILE_WORKERS,
        help="processes compiling structured-output grammars at once",
    )


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """`--uncapped-clients`: comma-separated addresses or networks."""
    try:
        return tuple(ipaddress.ip_network(part.strip()) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _serve(args: argparse.Namespace) -> int:
    from vllm_mamba.entrypoints.openai.api_server import run_server

    return run_server(args)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `serve [MODEL]` (or `serve --model MODEL`; by default the shipped model) on
    the `vllm-mamba` command."""
    parser = subparsers.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]",
        help="start an OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_model_args(parser, DEFAULT_MODEL)  # `serve MODEL` or `serve --model MODEL`
    add_server_args(parser)
    parser.set_defaults(func=_serve, parser=parser)
    return parser
