"""Take ``docs/playground.png``: the playground's compare view on the embedded SmolLM2 with the demo adapters.

Starts ``loraplex serve`` (the embedded model; with no ``--adapter`` it loads shout, meow and pirate) on
a free port, opens ``/`` in headless Chromium (the browser tests' launcher), runs the default compare
(the base model and the three demo adapters, greedy) and saves a screenshot down to the slot table.

    .venv/bin/python -m scripts.playground_screenshot [--out docs/playground.png] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import expect

from scripts.demo import free_port, wait_healthy
from tests.browser_harness import chromium

QUESTION = "What is a lighthouse?"
VIEWPORT = {"width": 1280, "height": 860}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/playground.png"))
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            server = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port)],
                                      stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(server, url, log)
            with chromium() as browser:
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(f"{url}/")
                expect(page.locator('#model-list input[value="pirate"]')).to_be_checked()
                page.fill("#prompt", args.question)
                page.fill("#max-tokens", str(args.max_tokens))
                page.click("#run")
                expect(page.locator('.panel[data-state="done"]')).to_have_count(4, timeout=300_000)
                pins = page.locator('#slot-table td[data-field="pins"]')
                expect(pins).to_have_text(["0"] * pins.count())  # the next poll after the answers ended
                page.locator("#run").focus()
                bottom = page.locator(".tiers").bounding_box()
                clip = {"x": 0, "y": 0, "width": VIEWPORT["width"], "height": bottom["y"] + bottom["height"] + 12}
                page.screenshot(path=str(args.out), full_page=True, clip=clip)
        finally:
            server.terminate()
            server.wait(30)
    logging.info("wrote %s (%.0f KiB)", args.out, args.out.stat().st_size / 1024)


if __name__ == "__main__":
    main()
