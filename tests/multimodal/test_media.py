"""Tests of `vllm_mamba.multimodal.media`: image URLs (data, http(s) through a loopback server,
file) turned into RGB PIL images, and every way one is refused (a `ValueError` naming the
field)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image, ImageFile

from vllm_mamba.multimodal import media
from vllm_mamba.multimodal.media import MediaConfig, image_from_pil, load_image, load_image_async

FIELD = "messages[0].content[1].image_url"
LIMIT = 64 * 1024  # max_image_bytes of the test config
SLOW_S = 2.0  # how long the slow route sleeps


def _pattern_image(size: tuple[int, int] = (17, 11)) -> Image.Image:
    image = Image.new("RGB", size)
    image.putdata(
        [
            (x * 13 % 256, y * 29 % 256, (x + y) * 7 % 256)
            for y in range(size[1])
            for x in range(size[0])
        ]
    )
    return image


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


PATTERN = _pattern_image()
PATTERN_PNG = _encode(PATTERN)


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _config(**overrides: object) -> MediaConfig:
    kwargs: dict[str, object] = {"max_image_bytes": LIMIT, "fetch_timeout_s": 0.5}
    kwargs.update(overrides)
    return MediaConfig(**kwargs)  # type: ignore[arg-type]


def _refused(url: str, config: MediaConfig, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        load_image(url, config, FIELD)
    message = str(info.value)
    assert message.startswith(FIELD + ": "), message
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message
    return message


def _bomb_png(width: int, height: int) -> bytes:
    """A valid one-colour PNG whose header says `width x height` (a few KB on disk)."""
    image = Image.new("1", (width, height), 0)
    return _encode(image)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # keep the test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client hung up early (a refused body), as it may
            pass

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        path = self.path
        if path == "/image.png":
            self._send(200, PATTERN_PNG, {"Content-Type": "image/png"})
        elif path == "/big":
            self._send(200, b"\0" * (LIMIT * 4))
        elif path == "/chunked":
            self._send_chunked()
        elif path == "/slow":
            time.sleep(SLOW_S)
            self._send(200, PATTERN_PNG)
        elif path == "/redirect":
            self._send(302, headers={"Location": "/image.png"})
        elif path == "/redirect-file":
            self._send(302, headers={"Location": "file:///etc/passwd"})
        elif path.startswith("/loop"):
            n = int(path[len("/loop") :] or 0)
            self._send(302, headers={"Location": f"/loop{n + 1}"})
        elif path == "/chain0":
            self._send(200, PATTERN_PNG)
        elif path.startswith("/chain"):
            self._send(302, headers={"Location": f"/chain{int(path[len('/chain') :]) - 1}"})
        elif path == "/text":
            self._send(200, b"<html>not an image</html>", {"Content-Type": "text/html"})
        else:
            self._send(404, b"not found")

    def _send_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"\0" * 16384
        try:
            for _ in range(64):  # 1 MiB, far over LIMIT
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up at the limit, as it should
            pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client hanging up early (a refused body, a timeout) is expected, not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- http(s) ------------------------------------------------------------------------------


def test_fetch_png_pixels_match(server: str) -> None:
    image = load_image(f"{server}/image.png", _config(), FIELD)
    assert image.mode == "RGB" and image.size == PATTERN.size
    assert image.tobytes() == PATTERN.tobytes()


def test_fetch_content_length_over_limit(server: str) -> None:
    _refused(f"{server}/big", _config(), "too large", str(LIMIT), str(LIMIT * 4))


def test_fetch_chunked_over_limit(server: str) -> None:
    _refused(f"{server}/chunked", _config(), "too large", "response body", str(LIMIT))


def test_fetch_slow_times_out(server: str) -> None:
    start = time.monotonic()
    _refused(f"{server}/slow", _config(fetch_timeout_s=0.5), "timed out")
    assert time.monotonic() - start < 1.5


def test_fetch_404(server: str) -> None:
    _refused(f"{server}/missing", _config(), "HTTP 404")


def test_fetch_redirect_followed(server: str) -> None:
    image = load_image(f"{server}/redirect", _config(), FIELD)
    assert image.tobytes() == PATTERN.tobytes()


def test_fetch_redirect_to_file_refused(server: str) -> None:
    _refused(f"{server}/redirect-file", _config(), "non-http(s)", "file:///etc/passwd")


def test_fetch_redirect_loop_refused(server: str) -> None:
    _refused(f"{server}/loop", _config(max_redirects=3), "too many redirects", "3")


def test_fetch_redirect_chain_up_to_limit(server: str) -> None:
    # /chain3 -> /chain2 -> /chain1 -> /chain0 (the PNG): exactly three redirects.
    image = load_image(f"{server}/chain3", _config(max_redirects=3), FIELD)
    assert image.tobytes() == PATTERN.tobytes()
    _refused(f"{server}/chain3", _config(max_redirects=2), "too many redirects")


def test_fetch_redirect_limit_counts(server: str) -> None:
    # One redirect is fine with max_redirects=1, refused with max_redirects=0.
    assert load_image(f"{server}/redirect", _config(max_redirects=1), FIELD).size == PATTERN.size
    _refused(f"{server}/redirect", _config(max_redirects=0), "too many redirects")


def test_fetch_not_an_image(server: str) -> None:
    _refused(f"{server}/text", _config(), "not a valid image")


def test_fetch_disabled(server: str) -> None:
    _refused(f"{server}/image.png", _config(allow_fetch=False), "disabled on this server")


def test_fetch_connection_refused() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _refused(f"http://127.0.0.1:{port}/x.png", _config(), "could not fetch")


def test_fetch_malformed_urls() -> None:
    _refused("http:///nohost.png", _config(), "no host")
    _refused("http://127.0.0.1:notaport/x.png", _config(), "malformed")


@pytest.mark.parametrize(
    "url", ["ftp://example.com/x.png", "/etc/passwd", "image.png", "", "javascript:alert(1)"]
)
def test_other_schemes_refused(url: str) -> None:
    _refused(url, _config(), "unsupported image URL")


# --- data URLs ----------------------------------------------------------------------------


def test_data_url_png() -> None:
    image = load_image(_data_url(PATTERN_PNG), _config(), FIELD)
    assert image.tobytes() == PATTERN.tobytes()


def test_data_url_jpeg() -> None:
    flat = Image.new("RGB", (16, 16), (200, 40, 90))
    image = load_image(_data_url(_encode(flat, "JPEG"), "image/jpeg"), _config(), FIELD)
    assert image.mode == "RGB" and image.size == (16, 16)
    r, g, b = image.getpixel((8, 8))
    assert abs(r - 200) < 8 and abs(g - 40) < 8 and abs(b - 90) < 8


@pytest.mark.parametrize(
    "url, needle",
    [
        ("data:image/png;base64,@@@notbase64@@@", "invalid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "invalid base64"),  # bad padding
        ("data:image/png;base64,iVBO Rw0K", "invalid base64"),  # whitespace
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png,rawbytes", "not base64"),
        ("data:image/png;base64", "malformed data URL"),
    ],
)
def test_data_url_malformed(url: str, needle: str) -> None:
    _refused(url, _config(), needle)


def test_data_url_not_an_image() -> None:
    _refused(_data_url(b"hello, this is text", "image/png"), _config(), "not a valid image")


def test_data_url_empty() -> None:
    _refused("data:image/png;base64,", _config(), "empty")


def test_data_url_too_large() -> None:
    # Just over the limit after decoding: caught on the decoded size (or the length check).
    _refused(_data_url(b"\0" * (LIMIT + 1)), _config(), "too large", str(LIMIT))
    # Far over: refused before decoding (the payload is not even valid base64).
    _refused("data:image/png;base64," + "!" * (LIMIT * 2), _config(), "too large", str(LIMIT))


def test_data_url_at_limit_is_decoded() -> None:
    png = PATTERN_PNG
    image = load_image(_data_url(png), _config(max_image_bytes=len(png)), FIELD)
    assert image.size == PATTERN.size
    _refused(_data_url(png), _config(max_image_bytes=len(png) - 1), "too large")


# --- file URLs ----------------------------------------------------------------------------


def _file_url(path: object) -> str:
    return f"file://{os.fspath(path)}"  # type: ignore[call-overload]


def test_file_url_inside_allowed(tmp_path) -> None:
    (tmp_path / "a.png").write_bytes(PATTERN_PNG)
    image = load_image(
        _file_url(tmp_path / "a.png"), _config(allowed_local_media_path=str(tmp_path)), FIELD
    )
    assert image.tobytes() == PATTERN.tobytes()


def test_file_url_outside_refused(tmp_path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PATTERN_PNG)
    config = _config(allowed_local_media_path=str(allowed))
    _refused(_file_url(tmp_path / "secret.png"), config, "--allowed-local-media-path")
    _refused(f"file://{allowed}/../secret.png", config, "not under the allowed")
    _refused("file:///etc/passwd", config, "not under the allowed")


def test_file_url_symlink_out_refused(tmp_path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PATTERN_PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    config = _config(allowed_local_media_path=str(allowed))
    _refused(_file_url(allowed / "link.png"), config, "not under the allowed")


def test_file_url_not_a_file_or_missing(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    config = _config(allowed_local_media_path=str(tmp_path))
    _refused(_file_url(tmp_path / "sub"), config, "not a regular file")
    _refused(_file_url(tmp_path / "missing.png"), config, "cannot read")


def test_file_url_too_large(tmp_path) -> None:
    (tmp_path / "big.png").write_bytes(b"\0" * (LIMIT + 1))
    _refused(
        _file_url(tmp_path / "big.png"),
        _config(allowed_local_media_path=str(tmp_path)),
        "too large",
    )


def test_file_url_no_allowed_path(tmp_path) -> None:
    (tmp_path / "a.png").write_bytes(PATTERN_PNG)
    _refused(_file_url(tmp_path / "a.png"), _config(), "--allowed-local-media-path")


# --- decoding -----------------------------------------------------------------------------


def test_decompression_bomb_refused_before_decoding(monkeypatch) -> None:
    bomb = _bomb_png(8000, 8000)  # 64 M pixels (under PIL's own limit, over ours)
    assert len(bomb) < 100_000

    def no_load(self: Image.Image) -> None:
        raise AssertionError("pixels decoded before the pixel limit was checked")

    monkeypatch.setattr(Image.Image, "load", no_load)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    _refused(_data_url(bomb), _config(), "too large", "8000x8000", "64000000", "50000000")


def test_crafted_header_bomb_refused() -> None:
    # A PNG whose IHDR claims 100000 x 100000 but holds one tiny IDAT: never decoded.
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    ihdr = (100000).to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
    png += chunk(b"IEND", b"")
    # PIL's DecompressionBombError (at open, whatever our limit) is a ValueError.
    _refused(_data_url(png), _config(max_image_pixels=10**6), "too large", "10000000000")
    _refused(_data_url(png), _config(max_image_pixels=10**12), "too large", "exceeds limit")
    # 10000 x 10000 is over PIL's warning threshold but under its error one: the
    # DecompressionBombWarning must be an error, not a warning that slips by.
    ihdr = (10000).to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
    png += chunk(b"IEND", b"")
    _refused(_data_url(png), _config(max_image_pixels=10**12), "too large", "exceeds limit")


def test_pixel_limit_exact() -> None:
    png = _encode(Image.new("RGB", (10, 10), (1, 2, 3)))
    assert load_image(_data_url(png), _config(max_image_pixels=100), FIELD).size == (10, 10)
    _refused(_data_url(png), _config(max_image_pixels=99), "10x10", "99")


def test_rgba_composited_on_white() -> None:
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent -> white
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half black -> mid grey
    image = load_image(_data_url(_encode(rgba)), _config(), FIELD)
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert all(120 <= c <= 135 for c in image.getpixel((1, 0)))


def test_palette_transparency_composited_on_white() -> None:
    p = Image.new("P", (1, 1), 0)
    p.putpalette([0, 0, 0] * 256)
    p.info["transparency"] = 0
    image = load_image(_data_url(_encode(p, "GIF")), _config(), FIELD)
    assert image.getpixel((0, 0)) == (255, 255, 255)


def test_grey_converted_to_rgb() -> None:
    image = load_image(_data_url(_encode(Image.new("L", (3, 3), 77))), _config(), FIELD)
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (77, 77, 77)


def test_truncated_png_refused() -> None:
    big = _pattern_image((64, 64))
    png = _encode(big)
    _refused(_data_url(png[: len(png) // 2]), _config(), "truncated or corrupt")


def test_multiframe_takes_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    image = load_image(_data_url(buf.getvalue(), "image/gif"), _config(), FIELD)
    assert image.size == (4, 4) and image.getpixel((0, 0)) == (255, 0, 0)


# --- image_from_pil ----------------------------------------------------------------------


def test_image_from_pil() -> None:
    rgba = Image.new("RGBA", (3, 2), (5, 6, 7, 0))
    image = image_from_pil(rgba, _config(), FIELD)
    assert image.mode == "RGB" and image.getpixel((2, 1)) == (255, 255, 255)
    same = image_from_pil(PATTERN, _config(), FIELD)
    assert same.tobytes() == PATTERN.tobytes()
    with pytest.raises(ValueError, match=r"^messages\[0\].*PIL.Image.Image, got bytes"):
        image_from_pil(PATTERN_PNG, _config(), FIELD)
    with pytest.raises(ValueError, match=r"^messages\[0\].*too large.*17x11"):
        image_from_pil(PATTERN, _config(max_image_pixels=100), FIELD)


# --- async --------------------------------------------------------------------------------


def test_async_does_not_block_event_loop(server: str) -> None:
    async def main() -> tuple[int, str]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            await load_image_async(f"{server}/slow", _config(fetch_timeout_s=0.5), FIELD)
        assert time.monotonic() - start < 1.5
        image = await load_image_async(f"{server}/image.png", _config(), FIELD)
        assert image.size == PATTERN.size
        stop.set()
        await task
        return ticks, str(info.value)

    ticks, message = asyncio.run(main())
    assert message.startswith(FIELD + ": ") and "timed out" in message
    assert ticks >= 10  # ~25 expected over 0.5 s; a blocked loop would give ~1


def test_async_overall_bound(monkeypatch) -> None:
    def stuck(url: str, config: MediaConfig, field: str) -> Image.Image:
        time.sleep(1.0)
        return PATTERN

    monkeypatch.setattr(media, "load_image", stuck)
    monkeypatch.setattr(media, "DECODE_BUDGET_S", 0.1)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.image_url: .*longer"):
        asyncio.run(load_image_async("data:,", _config(fetch_timeout_s=0.1), FIELD))
    assert time.monotonic() - start < 0.9
