"""The engine's failure types: what a caller of `LLMEngine` / `AsyncLLMEngine` may catch.

- `EngineStartupError`: the model loaded but cannot run as configured (found by the warm-up).
- `RequestsFailedError`: one step failed; only the requests of that step are ended (their
  slots freed) and the engine goes on serving.
- `EngineDeadError`: the engine cannot recover (or was shut down); a server exits non-zero.
"""

from __future__ import annotations


class EngineStartupError(RuntimeError):
    """The loaded model cannot run with the configured dtype, device and kernels."""


class RequestsFailedError(RuntimeError):
    """A step raised; its requests were ended and their slots freed.

    Attributes:
        request_ids: the requests that were in the failed step.
        cause: the original exception.
        status, param: how a server answers it (a subclass for the client's own fault: 400).
        outputs: outputs of other requests of the step, when the step itself ran.
    """

    status = 500
    param: str | None = None
    outputs: list = []  # noqa: RUF012 (never mutated)

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{len(request_ids)} request(s) failed in an engine step: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class EngineDeadError(RuntimeError):
    """The engine is shut down or failed beyond recovery; it serves no more requests."""


STARTUP_ERRORS = (ValueError, FileNotFoundError, EngineStartupError)
"""What a command reports in one line (no traceback) when the engine cannot start."""

_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "NCCL error")


def is_fatal(err: BaseException) -> bool:
    """True for errors after which the device or the engine's memory cannot be trusted."""
    if isinstance(err, (MemoryError, SystemError, EngineDeadError)):
        return True
    return any(marker in str(err) for marker in _FATAL_MARKERS)
