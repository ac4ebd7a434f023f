"""Turning an image reference a client sent into a decoded RGB `PIL.Image.Image`, safely.

This module owns every step between the string in an OpenAI-style `image_url` chat part (or a
Responses `input_image` part, or `LLM.chat`) and the decoded image the processors take:

- reading the encoded bytes: a `data:image/...;base64,` URL (strict base64), an `http(s)://` URL
  (fetched directly, without a proxy, under one deadline for connecting, every redirect and
  the body; redirects only to http(s) and at most `max_redirects`; the body streamed under the
  byte limit), or a `file://` URL under the one directory the operator allowed (symlinks
  resolved, so neither `..` nor a symlink leaves it);
- decoding them with PIL: the pixel count is checked from the header before any pixel is
  decoded (no decompression bombs), PIL's own bomb checks are errors, truncated or corrupt
  files are refused, multi-frame images give their first frame;
- converting to RGB, compositing an image with transparency on white first (as vLLM does).

`MediaConfig` holds the budgets. Every refusal is a `ValueError` whose message starts with the
request field it concerns (e.g. `messages[0].content[1].image_url: ...`) and says what is
wrong; network failures (DNS, refused connections, timeouts, TLS) become that error too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import io
import os
import re
import socket
import ssl
import stat
import time
import urllib.parse
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image

# Seconds `load_image_async` allows for decoding, on top of `MediaConfig.fetch_timeout_s`.
DECODE_BUDGET_S = 10.0
# Threads of the pool `load_image_async` runs loads in (its own, so that slow fetches never
# hold the event loop's default executor, which also resolves host names).
LOADER_THREADS = 16

_CHUNK_BYTES = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DATA_URL = re.compile(
    r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)", re.DOTALL | re.IGNORECASE
)
_URL_SAFE = "/%:@!$&'()*+,;=-._~?"
_MAX_URL_IN_MESSAGE = 200

_executor: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from, and how large they may be.

    Attributes:
        allow_fetch: whether `http://` / `https://` image URLs are fetched (False refuses them).
        allowed_local_media_path: the directory `file://` URLs may point into (symlinks
            resolved); None refuses every `file://` URL.
        fetch_timeout_s: the whole fetch of an http(s) URL: connecting, redirects and body.
        max_image_bytes: the largest encoded image: the HTTP body, the decoded bytes of a data
            URL, the file.
        max_image_pixels: the largest `width * height`, checked before the pixels are decoded.
        max_redirects: the most HTTP redirects followed for one image.
    """

    allow_fetch: bool = True
    allowed_local_media_path: str | None = None
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 50_000_000
    max_redirects: int = 3


def load_image(url: str, config: MediaConfig, field: str) -> Image.Image:
    """Read and decode the image `url` refers to, within `config`'s limits.

    Args:
        url: a `data:image/<type>;base64,...` URL, an `http(s)://` URL or a `file://` URL.
        config: the sources allowed and the budgets.
        field: the request field the URL came from; every error message starts with it.

    Returns:
        The image (its first frame), decoded, in mode RGB (transparency composited on white).

    Raises:
        ValueError: the URL is not allowed or malformed, the image cannot be read (network
            error, timeout, HTTP error status), is too large in bytes or pixels, or is not a
            valid image.
    """
    data = _read_bytes(url, config, field)
    return _decode(data, config, field)


async def load_image_async(url: str, config: MediaConfig, field: str) -> Image.Image:
    """`load_image` in a worker thread, so the event loop never fetches or decodes.

    The whole load is bounded by `config.fetch_timeout_s + DECODE_BUDGET_S`.

    Raises:
        ValueError: as `load_image`, or when the load takes longer than its bound.
    """
    bound = config.fetch_timeout_s + DECODE_BUDGET_S
    future = asyncio.get_running_loop().run_in_executor(
        _loader_executor(), load_image, url, config, field
    )
    try:
        return await asyncio.wait_for(future, timeout=bound)
    except asyncio.TimeoutError:
        raise ValueError(f"{field}: loading the image took longer than {bound:g} s") from None


def image_from_pil(image: object, config: MediaConfig, field: str) -> Image.Image:
    """Check and convert an image an `LLM` user passed as a `PIL.Image.Image`.

    Returns:
        A new RGB image (its current frame; transparency composited on white).

    Raises:
        ValueError: `image` is not a PIL image, has more than `config.max_image_pixels`
            pixels, or its pixels cannot be decoded.
    """
    if not isinstance(image, Image.Image):
        raise ValueError(f"{field}: expected a PIL.Image.Image, got {type(image).__name__}")
    _check_pixels(image, config, field)
    _load_pixels(image, field)
    return _to_rgb(image, field)


# --- reading the encoded bytes ------------------------------------------------------------


def _read_bytes(url: str, config: MediaConfig, field: str) -> bytes:
    """The encoded image `url` refers to.

    Raises:
        ValueError: the scheme is not supported or not allowed, or reading fails.
    """
    if not isinstance(url, str):
        raise ValueError(f"{field}: expected an image URL string, got {type(url).__name__}")
    colon = url.find(":", 0, 16)
    scheme = url[:colon].strip().lower() if colon > 0 else ""
    if scheme == "data":
        return _read_data_url(url, config, field)
    if scheme in ("http", "https"):
        if not config.allow_fetch:
            raise ValueError(
                f"{field}: fetching image URLs is disabled on this server; send the image "
                "inline as a data URL (data:image/png;base64,...)"
            )
        return _fetch(url, config, field)
    if scheme == "file":
        return _read_file_url(url, config, field)
    raise ValueError(
        f"{field}: unsupported image URL {_show(url)}: expected a data:image/...;base64, URL, "
        "an http(s):// URL or a file:// URL"
    )


def _read_data_url(url: str, config: MediaConfig, field: str) -> bytes:
    """The bytes of a base64 `data:image/...` URL.

    Raises:
        ValueError: malformed, not an image type, not base64, invalid base64 or too large.
    """
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise ValueError(f"{field}: malformed data URL (expected data:image/<type>;base64,...)")
    mime = match["mime"].strip().lower()
    if not mime.startswith("image/"):
        raise ValueError(f"{field}: data URL media type {mime!r} is not an image type")
    params = [p.strip().lower() for p in match["params"].split(";")]
    if "base64" not in params:
        raise ValueError(f"{field}: data URL is not base64-encoded (expected ;base64,)")
    payload = match["payload"]
    # 4 base64 characters per 3 bytes: a longer payload cannot decode within the limit.
    max_chars = 4 * -(-config.max_image_bytes // 3)
    if len(payload) > max_chars:
        raise ValueError(
            f"{field}: image too large: its base64 data is {len(payload)} characters, over "
            f"the {max_chars} that {config.max_image_bytes} bytes (the limit) take"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: data URL holds invalid base64 data") from None
    _check_size(len(data), config, field)
    return data


def _read_file_url(url: str, config: MediaConfig, field: str) -> bytes:
    """The bytes of a `file://` URL under `config.allowed_local_media_path`.

    Raises:
        ValueError: local files are not allowed, the path leaves the allowed directory, is not
            a regular file, cannot be read or is too large.
    """
    if config.allowed_local_media_path is None:
        raise ValueError(
            f"{field}: file:// image URLs are not allowed on this server (start it with "
            "--allowed-local-media-path DIR to allow files under DIR)"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{field}: file:// URL names a remote host {parts.netloc!r}")
    path = urllib.parse.unquote(parts.path)
    if not os.path.isabs(path) or "\0" in path:
        raise ValueError(f"{field}: file:// URL needs an absolute path, got {_show(url)}")
    root = os.path.realpath(config.allowed_local_media_path)
    target = os.path.realpath(path)
    if not os.path.isdir(root) or os.path.commonpath([root, target]) != root:
        raise ValueError(
            f"{field}: {_show(path)} is not under the allowed local media directory "
            f"(--allowed-local-media-path {config.allowed_local_media_path})"
        )
    return _read_regular_file(target, config, field)


def _read_regular_file(path: str, config: MediaConfig, field: str) -> bytes:
    """The bytes of the regular file at `path` (already resolved), at most the byte limit.

    Raises:
        ValueError: not a regular file, unreadable or too large.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{field}: {_show(path)} is not a regular file")
        fd = os.open(path, flags)
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {_show(path)}: {_os_reason(exc)}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{field}: {_show(path)} is not a regular file")
        _check_size(info.st_size, config, field)
        try:
            data = file.read(config.max_image_bytes + 1)
        except OSError as exc:
            raise ValueError(f"{field}: cannot read {_show(path)}: {_os_reason(exc)}") from None
    _check_size(len(data), config, field)
    return data


def _fetch(url: str, config: MediaConfig, field: str) -> bytes:
    """The body of an http(s) URL, following at most `config.max_redirects` redirects.

    Raises:
        ValueError: a network error, the deadline passed, a non-2xx status, a bad redirect
            (not http(s), too many, no Location) or a body over the byte limit.
    """
    deadline = time.monotonic() + config.fetch_timeout_s
    redirects = 0
    while True:
        location = _fetch_once(url, deadline, config, field)
        if isinstance(location, bytes):
            return location
        redirects += 1
        if redirects > config.max_redirects:
            raise ValueError(
                f"{field}: too many redirects fetching the image (the limit is "
                f"{config.max_redirects})"
            )
        url = urllib.parse.urljoin(url, location.strip())
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(
                f"{field}: image URL redirected to a non-http(s) URL {_show(url)}; refused"
            )


def _fetch_once(url: str, deadline: float, config: MediaConfig, field: str) -> bytes | str:
    """One GET of `url`: its body, or the Location of a redirect.

    Raises:
        ValueError: as `_fetch`.
    """
    host, port, target, is_https = _split_http_url(url, field)
    conn: http.client.HTTPConnection | None = None
    try:
        conn = _connection(host, port, is_https, _remaining(deadline, config, field))
        conn.connect()
        sock = conn.sock  # kept: the connection drops it once the response owns the socket
        sock.settimeout(_remaining(deadline, config, field))
        conn.request(
            "GET",
            target,
            headers={
                "User-Agent": "vllm_mamba",
                "Accept": "image/*",
                "Accept-Encoding": "identity",
            },
        )
        response = conn.getresponse()
        try:
            return _handle_response(response, sock, deadline, config, field)
        finally:
            response.close()
    except (OSError, http.client.HTTPException, UnicodeError) as exc:
        raise ValueError(
            f"{field}: could not fetch the image from {_show(url)}: {_net_reason(exc, config)}"
        ) from None
    finally:
        if conn is not None:
            conn.close()


def _connection(
    host: str, port: int | None, is_https: bool, timeout: float
) -> http.client.HTTPConnection:
    """An unconnected HTTP(S) connection to `host` (TLS verified with the system's CAs).

    Raises:
        http.client.InvalidURL: the host name holds characters a URL cannot.
    """
    if is_https:
        context = ssl.create_default_context()
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    return http.client.HTTPConnection(host, port, timeout=timeout)


def _handle_response(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    deadline: float,
    config: MediaConfig,
    field: str,
) -> bytes | str:
    """The body of a 2xx response, or the Location of a redirect.

    Raises:
        ValueError: a non-2xx, non-redirect status; a redirect without Location; a body over
            the byte limit; the deadline passed.
    """
    status = response.status
    if status in _REDIRECT_STATUSES:
        location = response.getheader("Location")
        if not location:
            raise ValueError(f"{field}: HTTP {status} redirect without a Location header")
        return location
    if not 200 <= status < 300:
        raise ValueError(f"{field}: fetching the image failed: HTTP {status} {response.reason}")
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit():
        _check_size(int(length), config, field)
    return _read_body(response, sock, deadline, config, field)


def _read_body(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    deadline: float,
    config: MediaConfig,
    field: str,
) -> bytes:
    """The response body, read as it arrives, refused as soon as it passes the byte limit.

    Raises:
        ValueError: the body is over the limit or the deadline passed.
    """
    body = bytearray()
    while True:
        sock.settimeout(_remaining(deadline, config, field))
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > config.max_image_bytes:
            raise ValueError(
                f"{field}: image too large: the response body is over the limit of "
                f"{config.max_image_bytes} bytes (read {len(body)} so far)"
            )


def _split_http_url(url: str, field: str) -> tuple[str, int | None, str, bool]:
    """`(host, port, request target, is https)` of an http(s) URL, the host IDNA-encoded.

    Raises:
        ValueError: no host, a bad port or host name.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        host = (parts.hostname or "").encode("idna").decode("ascii")
    except (ValueError, UnicodeError):
        raise ValueError(f"{field}: malformed image URL {_show(url)}") from None
    if not host:
        raise ValueError(f"{field}: image URL {_show(url)} has no host")
    target = urllib.parse.quote(parts.path or "/", safe=_URL_SAFE)
    if parts.query:
        target += "?" + urllib.parse.quote(parts.query, safe=_URL_SAFE)
    return host, port, target, parts.scheme.lower() == "https"


def _remaining(deadline: float, config: MediaConfig, field: str) -> float:
    """Seconds left before `deadline`.

    Raises:
        ValueError: none are left.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise ValueError(
            f"{field}: fetching the image timed out after {config.fetch_timeout_s:g} s"
        )
    return left


# --- decoding -----------------------------------------------------------------------------


def _decode(data: bytes, config: MediaConfig, field: str) -> Image.Image:
    """Decode encoded image bytes: header, pixel limit, pixels (first frame), RGB.

    Raises:
        ValueError: not an image, too many pixels, truncated or corrupt.
    """
    if not data:
        raise ValueError(f"{field}: the image is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ValueError(f"{field}: image too large: {exc}") from None
        except Exception:
            raise ValueError(f"{field}: the data is not a valid image") from None
    _check_pixels(image, config, field)
    _load_pixels(image, field)
    return _to_rgb(image, field)


def _check_pixels(image: Image.Image, config: MediaConfig, field: str) -> None:
    """Refuse an image whose header size is over the pixel limit (nothing decoded yet).

    Raises:
        ValueError: `width * height > config.max_image_pixels`, or a non-positive size.
    """
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"{field}: the image has no pixels ({width}x{height})")
    if width * height > config.max_image_pixels:
        raise ValueError(
            f"{field}: image too large: {width}x{height} = {width * height} pixels, over the "
            f"limit of {config.max_image_pixels}"
        )


def _load_pixels(image: Image.Image, field: str) -> None:
    """Decode the current frame's pixels, PIL's bomb warning an error.

    Raises:
        ValueError: the image is truncated, corrupt or a decompression bomb.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ValueError(f"{field}: image too large: {exc}") from None
        except Exception as exc:
            raise ValueError(f"{field}: the image is truncated or corrupt ({exc})") from None


def _to_rgb(image: Image.Image, field: str) -> Image.Image:
    """A new RGB copy of `image`, anything with transparency composited on white.

    Raises:
        ValueError: PIL cannot convert the image's mode.
    """
    try:
        if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as exc:
        raise ValueError(
            f"{field}: cannot convert the image (mode {image.mode}) to RGB ({exc})"
        ) from None


# --- helpers ------------------------------------------------------------------------------


def _check_size(size: int, config: MediaConfig, field: str) -> None:
    """Refuse an encoded image of `size` bytes over the byte limit.

    Raises:
        ValueError: `size > config.max_image_bytes`.
    """
    if size > config.max_image_bytes:
        raise ValueError(
            f"{field}: image too large: {size} bytes, over the limit of "
            f"{config.max_image_bytes} bytes"
        )


def _net_reason(exc: BaseException, config: MediaConfig) -> str:
    """A one-line reason for a network error (no traceback)."""
    if isinstance(exc, TimeoutError):
        return f"timed out after {config.fetch_timeout_s:g} s"
    return _os_reason(exc)


def _os_reason(exc: BaseException) -> str:
    """`ExceptionType: message`, or the type alone when the message is empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _show(text: str) -> str:
    """`text` quoted for an error message, cut to a readable length."""
    if len(text) > _MAX_URL_IN_MESSAGE:
        text = text[:_MAX_URL_IN_MESSAGE] + "..."
    return repr(text)


def _loader_executor() -> ThreadPoolExecutor:
    """The thread pool of `load_image_async`, made on first use."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=LOADER_THREADS, thread_name_prefix="media")
    return _executor
