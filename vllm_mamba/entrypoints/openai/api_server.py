"""The OpenAI-compatible HTTP server: the FastAPI app (routes, auth, error shape, engine
lifespan) and running it with uvicorn.

Run it with `vllm-mamba serve MODEL` or `python -m vllm_mamba.entrypoints.openai.api_server
--model MODEL`. On SIGINT or SIGTERM uvicorn stops accepting connections and lets in-flight
requests finish; after `GRACEFUL_SHUTDOWN_S` seconds the engine aborts whatever is left
(streams end with an error event and `[DONE]`, other requests get a 503), the connections
close and the port is released.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_mamba import __version__
from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.entrypoints.openai.cli_serve import API_KEY_ENV, HelpFormatter, add_server_args
from vllm_mamba.entrypoints.openai.errors import error_response, install_error_handlers
from vllm_mamba.entrypoints.openai.metrics import ServerMetrics
from vllm_mamba.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vllm_mamba.entrypoints.openai.served_model import ServedModel
from vllm_mamba.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_mamba.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_mamba.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0


class BearerAuth:
    """ASGI middleware: `/v1/*` needs `Authorization: Bearer <api_key>` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response("invalid or missing API key", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, args: argparse.Namespace) -> FastAPI:
    """The server's app around `engine`, configured by the parsed flags.

    Args:
        engine: the engine to serve; the app starts its loop and shuts it down.
        args: the flags of `add_server_args` plus `model`.
    """
    config = engine.engine.config
    names = list(args.served_model_name or [args.model])
    model = ServedModel(names, args.model, config.model_config.max_model_len)
    metrics = ServerMetrics(engine.engine, model.name)
    completions = OpenAIServingCompletion(engine, model, metrics)
    chat = OpenAIServingChat(engine, model, metrics)
    tokenization = OpenAIServingTokenization(engine, model, chat)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="vllm-mamba", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response("the engine loop failed", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(model.list().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(model.card(model_id).model_dump())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        return JSONResponse((await tokenization.tokenize(req)).model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(req)).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.info())

    return app


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


def run_server(args: argparse.Namespace) -> None:
    """Loads the model and serves it until SIGINT or SIGTERM."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    engine = AsyncLLMEngine.from_args(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        device=args.device,
    )
    app = build_app(engine, args)
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S) + 5,
    )
    GracefulServer(config, engine).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m vllm_mamba.entrypoints.openai.api_server --model MODEL [flags]`."""
    parser = argparse.ArgumentParser(
        description="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", required=True, help="a local model directory or a hub id")
    add_server_args(parser)
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
