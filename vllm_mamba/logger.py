"""The project's logging: one format for its own loggers and uvicorn's.

On import, the `vllm_mamba` logger gets a stderr handler at INFO (as vLLM does), unless
`VLLM_MAMBA_CONFIGURE_LOGGING=0` or the application configured it already. The server calls
`configure_logging(level)`, which routes uvicorn's loggers through the same handler; `generate`
and `chat` log warnings and errors only (`log_level`), and write the model's text through
`StreamedText`, so that a record never lands inside a line of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, TextIO

from vllm_mamba import envs

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_ROOT_NAME = "vllm_mamba"
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class StreamedText:
    """Model text written to `out` as it comes (each piece flushed). While it is entered and
    leaves a line open, a record of the project's handler bound for the same terminal or file
    first ends that line: the record starts on its own line and the text carries on below."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.open = False  # the last piece did not end its line

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.open = not text.endswith("\n")

    def end_line(self) -> None:
        """Ends the open line, if any."""
        if self.open:
            self.write("\n")

    def __enter__(self) -> StreamedText:
        _streaming.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _streaming.remove(self)


_streaming: list[StreamedText] = []


class LineHandler(logging.StreamHandler):
    """The project's handler: see `StreamedText`."""

    def emit(self, record: logging.LogRecord) -> None:
        for text in _streaming:
            if text.open and _same_file(text.out, self.stream):
                text.end_line()
        super().emit(record)


def _same_file(a: Any, b: Any) -> bool:
    """Whether two streams write to the same file or terminal."""
    if a is b:
        return True
    try:
        first, second = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (StringIO, closed)
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


@contextlib.contextmanager
def log_level(verbose: bool) -> Iterator[None]:
    """The level of a terminal command (`generate`, `chat`): warnings and errors only, info
    with `verbose`; the previous level is restored after."""
    project = logging.getLogger(_ROOT_NAME)
    previous = project.level
    project.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        project.setLevel(previous)


def _handler() -> logging.Handler:
    handler = LineHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    return handler


def init_logger() -> None:
    """Gives the `vllm_mamba` logger its default handler (once)."""
    if not envs.VLLM_MAMBA_CONFIGURE_LOGGING:
        return
    logger = logging.getLogger(_ROOT_NAME)
    if logger.handlers:
        return
    logger.addHandler(_handler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def configure_logging(level: str, uvicorn_level: str | None = None) -> None:
    """Sets the project's level and sends uvicorn's records through the same format.

    Args:
        level: the project's level name (`info`, `warning`, ...).
        uvicorn_level: uvicorn's level (default: `level`; `trace` is uvicorn's own).
    """
    init_logger()
    project = logging.getLogger(_ROOT_NAME)
    project.setLevel(_level(level))
    handlers = project.handlers or [_handler()]
    for name in _UVICORN_LOGGERS:
        uv = logging.getLogger(name)
        uv.handlers = list(handlers) if name == "uvicorn" else []
        uv.propagate = name != "uvicorn"
        uv.setLevel(_level(uvicorn_level or level))


def _level(name: str) -> int:
    if name.lower() == "trace":
        return 5  # uvicorn's TRACE level
    return getattr(logging, name.upper(), logging.INFO)
