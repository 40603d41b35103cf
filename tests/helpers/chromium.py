"""Real headless chromium for tests of pages the api serves (the live view; the dashboard of
issue 18 shares it): Debian's ``chromium`` and ``chromedriver`` (``make deps``), driven by
selenium (requirements.lock) with the driver binary given, so selenium never looks one up or
fetches one. A fresh profile dir per browser, removed at the end with the browser.

``CHROMIUM_FLAGS`` are the flags that work here as root (no sandbox, no GPU, nothing that
reaches the network on its own)."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000")


def missing() -> str | None:
    """Why no browser can be started here (None: it can)."""
    for p in (CHROMIUM, CHROMEDRIVER):
        if not p.exists():
            return f"no {p} (make deps installs Debian's chromium and chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium (make venv installs requirements.lock)"
    return None


@contextlib.contextmanager
def chromium(timeout_s: float = 60.0) -> Iterator[Any]:
    """A selenium WebDriver on a new headless chromium; quit and its profile removed at exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = Path(tempfile.mkdtemp(prefix="rollbox-chromium-"))
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(profile / "driver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        driver.set_page_load_timeout(timeout_s)
        driver.set_script_timeout(timeout_s)
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            shutil.rmtree(profile, ignore_errors=True)
