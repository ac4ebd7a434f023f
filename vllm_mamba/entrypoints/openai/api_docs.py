"""The API reference at `GET /docs`: a page of ours (`static/docs.html`, `docs.js`,
`docs.css`) that renders the app's `/openapi.json` (operations, parameters, request and
response schemas) and can send a request, in place of FastAPI's Swagger UI and ReDoc, which
load their scripts and styles from a CDN.

The web page at `/` keeps the API key in this origin's `localStorage`, which any script
running on the origin can read; so every file of this page is served from here, under a
Content-Security-Policy that runs only this origin's scripts and loads nothing from another
origin. The page itself reads no storage: the key it sends is typed into it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from vllm_mamba.entrypoints.openai.web_ui import page_headers, static_text

DOCS_PATH = "/docs"
ASSETS = {
    "docs.js": "text/javascript; charset=utf-8",
    "docs.css": "text/css; charset=utf-8",
}


def add_api_docs(app: FastAPI) -> None:
    """Serves the reference at `GET /docs` and its files at `GET /docs/<file>` on `app`
    (built with `docs_url=None, redoc_url=None`; the files are read once, now)."""
    headers = page_headers("'self'", "'self'")
    html = static_text("docs.html")
    assets = {name: (static_text(name), media) for name, media in ASSETS.items()}

    @app.get(DOCS_PATH, include_in_schema=False)
    async def api_docs() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    for name, (text, media) in assets.items():
        route = _static_route(Response(text, media_type=media, headers=headers))
        app.add_api_route(f"{DOCS_PATH}/{name}", route, methods=["GET"], include_in_schema=False)


def _static_route(response: Response) -> Callable[[], Awaitable[Response]]:
    """A route that answers `response` (the same bytes every time)."""

    async def static_file() -> Response:
        return response

    return static_file
