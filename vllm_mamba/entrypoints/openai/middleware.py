"""The server's ASGI middleware: API-key authentication and the request-body size limit."""

from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_mamba.entrypoints.openai.errors import error_response


class BearerAuth:
    """ASGI middleware: `/v1/*` needs `Authorization: Bearer <api_key>` (401 otherwise), as in
    vLLM; `/tokenize` with chat messages (which renders a chat template) checks the key in its
    route (`has_api_key`); plain `/tokenize`, `/detokenize`, `/health`, `/version`, `/metrics`,
    `/tokenizer_info` and the web UI's page do not need it (lm-eval's remote tokenizer calls
    `/tokenize` without a key).

    The scheme is matched in any case and the first `Authorization` header counts (vLLM).
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1") and not has_api_key(scope["headers"], self.api_key):
            response = error_response("invalid or missing API key", 401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def has_api_key(headers: list[tuple[bytes, bytes]], api_key: str | None) -> bool:
    """Whether a request with raw `headers` carries `api_key` (always, when there is none)."""
    if not api_key:
        return True
    token = _bearer_token(headers)
    return token is not None and secrets.compare_digest(token, api_key.encode())


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization` header when its scheme is Bearer."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets HTTP 413, whether it declares
    its length or streams it in chunks; nothing beyond the limit is buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"

    def _too_large(self) -> Response:
        return error_response(self._message(), 413)
