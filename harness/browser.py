"""Debian's chromium, headless and offline, for the console's and /docs' browser tests and the
console's bench."""

from __future__ import annotations

import shutil
from typing import Any

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def offline_chromium(console_log: bool = False) -> Any:
    """Debian's chromium, headless, driven by Selenium, that can reach nothing but 127.0.0.1 (every
    other name fails to resolve); with `console_log`, its console messages kept for get_log."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
