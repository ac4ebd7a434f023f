"""The server's web chat page: `static/index.html` (one file, inline CSS and JS) at `GET /`,
and what every HTML page of the server shares: its files read from `static/` and the
Content-Security-Policy that lets it load nothing from another origin.

The page is public (the API key guards `/v1/*` and `/tokenize` with chat messages); it asks for
the key itself, keeps it in this origin's `localStorage` and sends it on its API calls, so no
script from elsewhere may run on this origin: the page's inline script runs by its hash, and
no other script runs.
`--disable-web-ui` leaves the route out, so `/` is a 404.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "index.html"
_INLINE_SCRIPT = re.compile(r"<script(\s[^>]*)?>(.*?)</script>", re.S | re.I)


def static_text(name: str) -> str:
    """A file's text, as shipped in the package's `static/` folder."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def page_html() -> str:
    """The chat page's text."""
    return static_text(PAGE)


def page_headers(script_src: str, style_src: str) -> dict[str, str]:
    """The headers of an HTML page (or a file it loads) whose scripts and styles are
    `script_src` and `style_src` (CSP sources): it loads nothing from another origin, talks
    only to this one, frames nothing and is framed by nothing."""
    policy = (
        f"default-src 'none'; script-src {script_src}; style-src {style_src}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }


def inline_script_sources(html: str) -> str:
    """The CSP sources that let exactly `html`'s inline scripts run: their SHA-256 hashes."""
    hashes = []
    for attrs, body in _INLINE_SCRIPT.findall(html):
        if re.search(r"\bsrc\s*=", attrs or ""):
            continue
        digest = hashlib.sha256(body.replace("\r\n", "\n").encode()).digest()
        hashes.append(f"'sha256-{base64.b64encode(digest).decode()}'")
    return " ".join(hashes) or "'none'"


def add_web_ui(app: FastAPI) -> None:
    """Serves the chat page at `GET /` on `app` (read once, now)."""
    html = page_html()
    # Inline styles stay allowed (the page's rendering may set them): a style cannot read
    # the key, and img-src keeps it from fetching anything from elsewhere.
    headers = page_headers(inline_script_sources(html), "'unsafe-inline'")

    @app.get("/", include_in_schema=False)
    async def web_ui() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)
