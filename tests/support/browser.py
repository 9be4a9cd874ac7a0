"""Debian's headless Chromium driven by selenium through Debian's chromedriver (never a downloaded
browser): the console's end-to-end tests and its screenshots."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

CHROMIUM = os.environ.get("TOKENWAY_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TOKENWAY_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def require_browser() -> None:
    """Skip without Chromium and chromedriver, or fail when TOKENWAY_REQUIRE_BROWSER=1 (CI)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        message = f"needs Debian's chromium and chromium-driver ({', '.join(missing)} missing)"
        if os.environ.get("TOKENWAY_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tokenway-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
