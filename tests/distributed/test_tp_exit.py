"""A tensor-parallel engine's end logs no error, whether it is shut down or still alive when
the script ends; a script that builds it without the `if __name__ == "__main__":` guard (its
worker processes import the script again) is told so in one line.

Both run as scripts in a subprocess: the end of the interpreter is what is checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import vllm_mamba
from tests.tiny_models import tiny_model_dir

SCRIPT = """
import sys
from vllm_mamba import LLM, SamplingParams

def make():
    return LLM(sys.argv[1], tensor_parallel_size=2, max_num_seqs=2, max_model_len=64)

def tokens(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    return out[0].outputs[0].token_ids

{guard}
    for _ in range(3):
        with make() as llm:
            print(tokens(llm), flush=True)
    llm = make()  # left running: the interpreter's exit stops its workers
    print(tokens(llm), flush=True)
"""
GUARD = 'if __name__ == "__main__":'
TIMEOUT_S = 240


def _run(tmp_path: Path, guard: str) -> subprocess.CompletedProcess:
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT.format(guard=guard))
    # The script imports the package these tests import.
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_mamba.__file__)))
    return subprocess.run(
        [sys.executable, str(script), tiny_model_dir("tied")],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_engines_shut_down_or_left_running_end_without_error(tmp_path: Path) -> None:
    done = _run(tmp_path, GUARD)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and len(set(lines)) == 1, done.stdout  # four engines, same tokens
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_script_without_main_guard_is_told_in_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, "if True:")
    assert done.returncode != 0 and not done.stdout
    guard_lines = [line for line in done.stderr.splitlines() if GUARD in line]
    # The worker's line, and rank 0's startup error; not multiprocessing's bootstrapping
    # traceback.
    assert guard_lines and "bootstrapping phase" not in done.stderr, done.stderr
    assert guard_lines[0].startswith("vllm_mamba: "), done.stderr
    assert "EngineStartupError: tensor parallelism could not start" in done.stderr, done.stderr
