"""Redraws `docs/web_ui.png` from the real page: serves the shipped model
(`vllm-mamba/tiny-stdlib`, which writes Python), asks it for one function in the web chat page
in headless Chromium, and screenshots the page with its reply.

    python scripts/web_ui_screenshot.py [--out docs/web_ui.png]

Needs Chromium (`scripts/install_chromium.sh`). Greedy decoding, so the picture is the same on
every run of the same model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.entrypoints.chromium import headless_chromium  # noqa: E402
from tests.entrypoints.conftest import _wait_healthy, start_server  # noqa: E402

MODEL = "vllm-mamba/tiny-stdlib"
PROMPT = "def read_config(path):"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "web_ui.png"))
    args = parser.parse_args()
    server, port = start_server(
        ["--model", MODEL, "--max-model-len", "2048", "--log-level", "warning"]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url)
        with headless_chromium(width=1000, height=620) as page:
            page.navigate(f"{url}/")
            page.wait_for(f"document.getElementById('model-name').textContent === '{MODEL}'")
            for field, value in {"temperature": "0", "max_tokens": "120"}.items():
                page.type_into(f"#{field}", value)
            page.type_into("#input", PROMPT)
            page.click("#send")
            page.wait_for(
                "[...document.querySelectorAll('.msg.assistant')].at(-1)?.dataset.state"
                " && [...document.querySelectorAll('.msg.assistant')].at(-1).dataset.state"
                " !== 'streaming'",
                120,
                "the reply",
            )
            page.screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
