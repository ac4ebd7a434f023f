"""The project's logging: one format for its own loggers and uvicorn's.

On import, the `vllm_mamba` logger gets a stderr handler at INFO (as vLLM does), unless
`VLLM_MAMBA_CONFIGURE_LOGGING=0` or the application configured it already. The server calls
`configure_logging(level)`, which routes uvicorn's loggers through the same handler.
"""

from __future__ import annotations

import logging

from vllm_mamba import envs

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_ROOT_NAME = "vllm_mamba"
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def _handler() -> logging.Handler:
    handler = logging.StreamHandler()
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
