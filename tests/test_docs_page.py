"""/docs in a real browser (Debian's chromium) that can reach nothing but the service: Swagger UI
comes from the service's own files, and renders every operation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import ROUTE, running_service

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER), reason="needs Debian's chromium: apt-get install -y chromium chromium-driver"
)


def test_the_api_page_renders_every_operation_offline(db_url: str, tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        # No internet: every name but the service's address fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
        try:
            browser.get(f"{url}/docs")
            WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".opblock")) >= 9)
            described = browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-description")
            summaries = {element.text for element in described}
            resources = browser.execute_script(
                "return performance.getEntriesByType('resource').map(entry => entry.name)"
            )
            browser.save_screenshot(str(tmp_path / "docs.png"))
        finally:
            browser.quit()
    assert {"Acquire a lock", "Release a lock", "Renew a lease (heartbeat)", "List locks"} <= summaries
    assert resources and all(name.startswith(url) for name in resources), resources
