"""Headless Chromium for the HTML tests (report and what-if pages), launched one way everywhere.

Debian's ``chromium`` driven by Python playwright (never ``playwright install``), with the flags that
keep it off the network; the page records console errors, page errors, dialogs and every request URL.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from playwright.sync_api import sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@dataclass(slots=True)
class BrowserLog:
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[tuple[Any, BrowserLog]]:
    """A fresh page and what it logged; the browser closes on exit."""
    log = BrowserLog()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda msg: log.errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: log.errors.append(str(exc)))
            page.on("dialog", lambda d: (log.errors.append(f"dialog: {d.message}"), d.dismiss()))
            page.on("request", lambda req: log.requests.append(req.url))
            yield page, log
        finally:
            browser.close()
