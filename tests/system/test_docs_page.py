"""/docs in a real browser (Debian's chromium) that can reach nothing but the service: Swagger UI
comes from the service's own files, and renders every operation."""

from __future__ import annotations

from pathlib import Path

from harness.browser import offline_chromium
from harness.processes import running_service
from tests.support import ROUTE, needs_chromium


@needs_chromium
def test_the_api_page_renders_every_operation_offline(db_url: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        browser = offline_chromium()
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
