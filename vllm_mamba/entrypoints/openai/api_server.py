"""The OpenAI-compatible HTTP server: the FastAPI app (routes, auth, CORS, error shape, engine
lifespan) and running it with uvicorn (over https with the TLS flags).

Run it with `vllm-mamba serve MODEL` or `python -m vllm_mamba.entrypoints.openai.api_server
--model MODEL`. On SIGINT or SIGTERM uvicorn stops accepting connections and lets in-flight
requests finish; after `GRACEFUL_SHUTDOWN_S` seconds the engine aborts whatever is left
(streams end with an error event and `[DONE]`, other requests get a 503), the connections
close and the port is released.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from vllm_mamba import __version__, envs
from vllm_mamba.engine import native_memory
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.entrypoints.chat_utils import ChatTemplate
from vllm_mamba.entrypoints.cli_args import Parser, print_error
from vllm_mamba.entrypoints.openai.api_docs import add_api_docs
from vllm_mamba.entrypoints.openai.cli_serve import HelpFormatter, add_server_args
from vllm_mamba.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from vllm_mamba.entrypoints.openai.http_protocol import ConnectionLimits, deadline_protocol
from vllm_mamba.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vllm_mamba.entrypoints.openai.metrics import ServerMetrics
from vllm_mamba.entrypoints.openai.middleware import BearerAuth, BodySizeLimit, has_api_key
from vllm_mamba.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vllm_mamba.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm_mamba.entrypoints.openai.served_model import ServedModel
from vllm_mamba.entrypoints.openai.serving_chat import ChatParsers, OpenAIServingChat
from vllm_mamba.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_mamba.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm_mamba.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm_mamba.entrypoints.openai.web_ui import add_web_ui
from vllm_mamba.errors import STARTUP_ERRORS
from vllm_mamba.logger import configure_logging

logger = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)


GRACEFUL_SHUTDOWN_S = 5.0


def build_app(engine: AsyncLLMEngine, args: argparse.Namespace) -> FastAPI:
    """The server's app around `engine`, configured by the parsed flags.

    Args:
        engine: the engine to serve; the app starts its loop and shuts it down.
        args: the flags of `add_server_args` plus `model`.

    Raises:
        ValueError: a `--chat-template` that does not compile.
    """
    mc = engine.model_config
    model = ServedModel(list(mc.served_model_name or [mc.model]), mc.model, mc.max_model_len)
    metrics = ServerMetrics(engine, model.name)
    template = ChatTemplate(engine.tokenizer, args.chat_template, args.trust_request_chat_template)
    logger.info("Chat template: %s", template.source)
    parsers = chat_parsers(args)
    completions = OpenAIServingCompletion(engine, model, metrics)
    chat = OpenAIServingChat(engine, model, metrics, template, parsers)
    tokenization = OpenAIServingTokenization(engine, model, chat)
    responses = OpenAIServingResponses(chat)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    # FastAPI's /docs and /redoc load their scripts from a CDN: /docs is a page of ours.
    app = FastAPI(
        title="vllm-mamba", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    api_key = args.api_key or envs.VLLM_MAMBA_API_KEY
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(BodySizeLimit, max_bytes=args.max_request_bytes)
    # Added last, so outermost (vLLM's CORS): a preflight OPTIONS is answered without the API
    # key, and the 401s and 413s of the middleware inside carry the CORS headers too.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),  # the flags' defaults
        allow_credentials=getattr(args, "allow_credentials", False),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
    )

    @app.get("/health")
    async def health() -> Response:
        if engine.errored or not engine.is_running:
            return error_response("the engine is not serving", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(model.list().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(model.card(model_id).model_dump())

    defaults = mc.sampling_defaults

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(apply_sampling_defaults(req, defaults), raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(apply_sampling_defaults(req, defaults), raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(
            req, raw, functools.partial(apply_sampling_defaults, defaults=defaults)
        )

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/tokenize")
    async def tokenize(
        req: TokenizeCompletionRequest | TokenizeChatRequest, raw: Request
    ) -> JSONResponse:
        # Chat messages render a chat template (a request's own with
        # --trust-request-chat-template): behind the key, as /v1 is.
        if isinstance(req, TokenizeChatRequest) and not has_api_key(raw.scope["headers"], api_key):
            raise APIError("invalid or missing API key", 401)
        return JSONResponse((await tokenization.tokenize(req)).model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(req)).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.info())

    add_api_docs(app)
    if not getattr(args, "disable_web_ui", False):  # a Namespace built by hand may lack it
        add_web_ui(app)
    return app


def chat_parsers(args: argparse.Namespace) -> ChatParsers:
    """The server's tool-call and reasoning parsers (after loading `--tool-parser-plugin`).

    Raises:
        ValueError: an unknown parser, or a plugin that cannot be loaded.
    """
    plugin = getattr(args, "tool_parser_plugin", None)
    if plugin:
        load_plugin_file(plugin)
    parsers = ChatParsers(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
    if parsers.tool_call_parser or parsers.reasoning_parser:
        logger.info(
            "Tool-call parser: %s (auto tool choice %s); reasoning parser: %s",
            parsers.tool_call_parser,
            "on" if parsers.enable_auto_tool_choice else "off",
            parsers.reasoning_parser,
        )
    return parsers


def load_plugin_file(path: str) -> None:
    """Imports a Python file (its parsers register themselves on import).

    Raises:
        ValueError: the file does not exist or fails to import.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_mamba_tool_parser_plugin", path)
    if spec is None or spec.loader is None or not os.path.isfile(path):
        raise ValueError(f"--tool-parser-plugin: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a plugin's own error, reported at startup
        raise ValueError(f"--tool-parser-plugin {path!r} failed to import: {err}") from err


def apply_sampling_defaults(req: T, defaults: dict[str, Any]) -> T:
    """Fills the sampling fields the request left unset from the model's generation config."""
    given = req.model_fields_set
    for name, value in defaults.items():
        if name == "max_tokens" and "max_completion_tokens" in given:
            continue
        if name in type(req).model_fields and name not in given:
            setattr(req, name, value)
    return req


class GracefulServer(uvicorn.Server):
    """A uvicorn server that aborts the engine's requests when the shutdown grace runs out."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list | None = None) -> None:
        """Drains connections; aborts the requests still running after the grace period."""
        watchdog = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            watchdog.cancel()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(GRACEFUL_SHUTDOWN_S)
        logger.info("shutdown grace period over: aborting the requests still running")
        await self.engine.shutdown()


def run_server(args: argparse.Namespace) -> int:
    """Binds the port, loads the model and serves it until SIGINT or SIGTERM.

    Returns:
        The exit status: 0 after a clean shutdown, 2 for an option or model that cannot be
        used, 1 when the port is taken or the engine failed beyond recovery (a startup error
        is one `error: ...` line on standard error, as every subcommand's, no traceback).
    """
    configure_logging(args.log_level, args.uvicorn_log_level)
    native_memory.limit_arenas()
    try:
        sock = bind_socket(args.host, args.port) if args.fd is None else inherited_socket(args.fd)
    except OSError as err:
        where = f"--fd {args.fd}" if args.fd is not None else f"{args.host}:{args.port}"
        print_error(f"cannot listen on {where}: {err.strerror or err}")
        return 1
    try:
        server = _load_server(args, sock)
    except STARTUP_ERRORS as err:
        sock.close()
        print_error(err)
        return 2
    native_memory.freeze_startup_heap()
    server.run(sockets=[sock])
    return 1 if server.engine.errored else 0


def _load_server(args: argparse.Namespace, sock: socket.socket) -> GracefulServer:
    """Loads the engine and builds the app and the uvicorn server around it."""
    tls = tls_options(args)  # checked before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    holder: list[GracefulServer] = []

    def on_dead(_: BaseException) -> None:
        logger.critical("the engine cannot recover: shutting the server down (exit status 1)")
        holder[0].should_exit = True

    engine = AsyncLLMEngine.from_engine_args(
        engine_args,
        on_dead=on_dead,
        log_requests=args.log_requests,
        grammar_workers=args.grammar_compile_workers,
        grammar_timeout_s=args.grammar_compile_timeout,
        stall_timeout_s=args.stream_stall_timeout or None,
        max_slots_per_request=args.max_slots_per_request,
    )
    app = build_app(engine, args)
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    logger.info("Serving %s on %s://%s:%d", engine_args.model, scheme, host, port)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=args.uvicorn_log_level or args.log_level,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S) + 5,
        timeout_keep_alive=args.timeout_keep_alive,
        http=deadline_protocol(connection_limits(args)),
        **tls,
    )
    holder.append(GracefulServer(config, engine))
    return holder[0]


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The connection deadlines and caps from the flags."""
    return ConnectionLimits(
        first_byte_timeout=args.first_byte_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        uncapped_clients=args.uncapped_clients,
    )


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's `ssl_*` settings from the TLS flags (empty: plain http); the key and the
    certificates are loaded once here, so a bad file fails at startup, not on `run`.

    Raises:
        ValueError: only one of --ssl-keyfile / --ssl-certfile, client-certificate flags
            without TLS, or files that do not load.
    """
    keyfile, certfile = args.ssl_keyfile, args.ssl_certfile
    if bool(keyfile) != bool(certfile):
        given, missing = ("--ssl-keyfile", "--ssl-certfile")[:: 1 if keyfile else -1]
        raise ValueError(f"{given} needs {missing}: https takes both a key and a certificate")
    if not keyfile:
        if args.ssl_ca_certs or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile/--ssl-certfile")
        return {}
    options: dict[str, Any] = {
        "ssl_keyfile": keyfile,
        "ssl_certfile": certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }
    try:  # what uvicorn's Config.load() does with them
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certfile, keyfile)
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as err:  # a missing file, or not a PEM key/certificate
        raise ValueError(f"TLS: cannot load the key, certificate or CA file: {err}") from None
    return options


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port`, bound before the model loads.

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets whose proto says
    # TCP (it inherits from this one); without it every multi-write response waits for the
    # client's delayed ACK (~40 ms on a keep-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The listening TCP socket this process inherited as file descriptor `fd` (`--fd`): a
    supervisor or a test harness bound it, so the port is known before the server starts and
    nothing else can take it in between.

    Raises:
        OSError: `fd` is not an open socket, not a TCP stream socket, or not listening.
    """
    sock = socket.socket(fileno=fd)  # family, type and protocol read from the descriptor
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"file descriptor {fd} is not a TCP socket")
        if not listening:
            raise OSError(f"the socket of file descriptor {fd} is not listening")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see `bind_socket`
    except OSError:
        sock.detach()  # the descriptor stays the caller's
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm_mamba.entrypoints.openai.api_server --model MODEL [flags]`."""
    parser = Parser(
        description="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", required=True, help="a local model directory or a hub id")
    add_server_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
