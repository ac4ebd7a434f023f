"""The README and the user guide against the tree: every relative link (and `#anchor`) leads
somewhere, every `VLLM_MAMBA_*` variable and `vllm-mamba` flag they name exists, the README's
performance figures are those of the performance page, and the README stays a short page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]
    + list((ROOT / "examples").glob("*/README.md"))
)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# Flags of other programs that the pages show next to ours (pip, docker, ray, pytest, ...).
_OTHER_TOOLS_FLAGS = {
    "--no-build-isolation", "--build-arg", "--num-gpus", "--num-cpus", "--head", "--address",
    "--port", "--cpus", "--dist", "--rm", "--name", "--gpus", "--no-install-recommends",
    "--index-url", "--extra-index-url", "--skip-transformers", "--skip-llama-cpp", "--model",
    "--isa", "--arch", "--dtype", "--quantization", "--rwkv-pth", "--engine-threads",
    "--match", "--num-iters", "--threads", "--user", "--now", "--cpuset-cpus",
    "--no-create-home", "--health-cmd", "--shell", "--format", "--inplace",
    # benchmark scripts
    "--rounds", "--calls", "--formats",
    # lm-evaluation-harness
    "--include", "--log", "--output", "--tasks", "--batch",
}  # fmt: skip


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    broken = ["../shared/ (outside the repository)"] if "../shared/" in doc.read_text() else []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def _code_text() -> str:
    files = [*(ROOT / "vllm_mamba").rglob("*.py"), ROOT / "setup.py", ROOT / "Makefile"]
    files += [ROOT / "Dockerfile", *(ROOT / "csrc").glob("*.h"), *(ROOT / "csrc").glob("*.cpp")]
    return "\n".join(p.read_text() for p in files if p.exists())


def test_every_environment_variable_named_is_read_by_the_code() -> None:
    code = _code_text()
    named = {v for doc in DOCS for v in re.findall(r"\bVLLM_MAMBA_[A-Z0-9_]+", doc.read_text())}
    assert named, "the docs name no VLLM_MAMBA_* variable"
    assert not sorted(v for v in named if v not in code)


def _cli_flags() -> set[str]:
    from vllm_mamba.entrypoints.cli import build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return flags


def test_every_vllm_mamba_flag_named_exists() -> None:
    known = _cli_flags()
    unknown = {}
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = doc.read_text()
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)):
            if flag not in known and flag not in _OTHER_TOOLS_FLAGS:
                unknown.setdefault(doc.name, []).append(flag)
    assert not unknown, unknown


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_readme_performance_figures_are_the_performance_pages() -> None:
    readme = _section((ROOT / "README.md").read_text(), "Performance")
    page = (ROOT / "docs" / "performance.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "---" not in line]
    figures = {f for row in rows for f in re.findall(r"\b\d[\d,]*(?:\.\d+)?\b", row)}
    figures -= {"1", "32", "512", "5", "24"}  # workload names and the version, not results
    assert figures, "no figures in the README's performance table"
    assert not sorted(f for f in figures if f not in page)


def test_readme_is_a_short_page_with_the_two_commands_up_front() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    top = "\n".join(lines[:45])
    assert "make demo" in top and "make test" in top
