"""A headless Chromium for the playground's browser tests: Debian's build, driven by Playwright.

Playwright cannot download its own browsers here, so it drives ``/usr/bin/chromium`` (``make install``
installs it; ``LORAPLEX_CHROMIUM`` points elsewhere). Each launch gets a fresh temporary profile, and
the flags keep Chromium off the network (no background fetches, updates, sync or QUIC probes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Browser, sync_playwright

CHROMIUM = Path(os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        raise RuntimeError(f"no Chromium at {CHROMIUM}: `make install` installs Debian's chromium "
                           "(or set LORAPLEX_CHROMIUM to a Chromium executable)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, chromium_sandbox=False,
                                             args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
