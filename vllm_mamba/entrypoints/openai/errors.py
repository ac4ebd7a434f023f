"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the app's
exception handlers that produce them (bad input 400, auth 401, unknown model or route 404).
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_mamba.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm_mamba.errors import EngineDeadError, RequestsFailedError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}
_PARAM = re.compile(r"SamplingParams\.(\w+)")
_LEADING_PARAMS = {
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
    "stop_token_ids": "stop_token_ids",
    "messages": "messages",
    "'max_tokens'": "max_tokens",  # the engine's (vLLM's) "'max_tokens' ... is too large"
}


class APIError(Exception):
    """An error to return to the client with `status`."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_response(
    message: str, status: int, param: str | None = None, code: int | str | None = None
) -> JSONResponse:
    """A JSON response in OpenAI's error shape (text the client sent that is not valid
    Unicode, such as a lone surrogate echoed in a message, is replaced)."""
    message = message.encode("utf-8", "replace").decode("utf-8")
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    info = ErrorInfo(message=message, type=err_type, param=param, code=code or status)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


ENGINE_ERRORS = (EngineDeadError, RequestsFailedError)


def engine_error_status(err: BaseException) -> int:
    """503 when the engine is not serving, else the failed request's status (500 when it
    failed inside a step, 400 when its own grammar ended it)."""
    return 503 if isinstance(err, EngineDeadError) else getattr(err, "status", 500)


def error_from_value_error(err: ValueError) -> APIError:
    """A 400 `APIError` from the engine's validation error, naming the field when it can."""
    message = str(err)
    match = _PARAM.search(message)
    first = message.split(" ", 1)[0]
    if match:
        param = match.group(1)
    elif first in _LEADING_PARAMS:
        param = _LEADING_PARAMS[first]
    else:
        param = "prompt" if "prompt" in message or "input tokens" in message else None
    return APIError(message, 400, param=param)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending parameter of a request validation error."""
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "lone_surrogate":  # protocol.ClientRequest: names the field
        return first["msg"], first["ctx"]["param"]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def internal_error_message(err: BaseException) -> str:
    """Logs an unexpected error with its traceback (the details stay in the server's log) and
    returns what the client is told: its kind only."""
    logger.error("internal error", exc_info=err)
    return f"internal server error ({type(err).__name__})"


def install_error_handlers(app: FastAPI) -> None:
    """Registers handlers that answer every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.message, err.status, err.param, err.code)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, err: ValueError) -> JSONResponse:
        api = error_from_value_error(err)
        return error_response(api.message, api.status, api.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        status = err.status_code
        message = err.detail if isinstance(err.detail, str) else HTTPStatus(status).phrase
        return error_response(message, status)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return error_response(str(err), 503)

    @app.exception_handler(RequestsFailedError)
    async def _request_failed(_: Request, err: RequestsFailedError) -> JSONResponse:
        return error_response(str(err), err.status, err.param)

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception) -> JSONResponse:
        response = error_response(internal_error_message(err), 500)
        # Starlette re-raises the exception after this response, and uvicorn then closes the
        # connection: say so, or a keep-alive client sends its next request into a closed one.
        response.headers["connection"] = "close"
        return response
