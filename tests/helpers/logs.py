"""Capturing the project's log records in a test: its loggers do not propagate to the root,
where pytest's `caplog` listens, so the handler is attached to the logger itself."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def captured(
    caplog: pytest.LogCaptureFixture, name: str = "vllm_mamba", level: int = logging.INFO
) -> Iterator[pytest.LogCaptureFixture]:
    """Within the block, records of logger `name` at `level` and above reach `caplog`."""
    logger = logging.getLogger(name)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger=name):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
