"""Directories of the test session (tiny checkpoints), removed when the session's process ends.

`tempfile.mkdtemp` alone leaves every saved model behind: a full run wrote ~80 of them, and a
developer's `/tmp` had 31 GB of old ones. Everything goes under one root directory per
pytest process, which an `atexit` handler of that process deletes (forked workers, which end
by `os._exit`, never run it, and the handler checks the pid besides).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile


def _remove(root: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(root, ignore_errors=True)


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="vllm-mamba-tests-")
    atexit.register(_remove, root, os.getpid())
    return root


def make_tmp_dir(prefix: str) -> str:
    """A new empty directory named `prefix...` under the session's root."""
    return tempfile.mkdtemp(prefix=prefix, dir=_root())
