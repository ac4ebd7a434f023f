"""The server's web chat page: `static/index.html` (one file, inline CSS and JS) at `GET /`.

The page is public (the API key guards `/v1/*` only); it asks for the key itself and sends it
on its API calls. `--disable-web-ui` leaves the route out, so `/` is a 404.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "index.html"


def page_html() -> str:
    """The page's text, as shipped in the package's `static/` folder."""
    return resources.files(__package__).joinpath("static", PAGE).read_text(encoding="utf-8")


def add_web_ui(app: FastAPI) -> None:
    """Serves the chat page at `GET /` on `app` (read once, now)."""
    html = page_html()
    # The page loads nothing from elsewhere and frames nothing: a strict policy costs nothing.
    headers = {
        "Content-Security-Policy": (
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"
        ),
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    @app.get("/", include_in_schema=False)
    async def web_ui() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)
