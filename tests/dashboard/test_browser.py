"""End to end in a real browser: `streamlit run app.py` on a free port, headless Chromium driven by
Selenium through the system chromedriver. Loads every page, runs a small plan by pressing the
button, and saves a screenshot of each page: to a temporary folder, or to the folder named by
SERVEPLAN_SCREENSHOTS_DIR (`SERVEPLAN_SCREENSHOTS_DIR=docs/screenshots pytest tests/dashboard/test_browser.py`
refreshes the README's images), so that running the suite never rewrites tracked files.

Waits on page elements, never on fixed sleeps: Streamlit draws over a websocket after the HTML
loads, so a plain `chromium --screenshot` captures it half-drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
import os
from pathlib import Path
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# CI (.ci/run) installs both and sets SERVEPLAN_REQUIRE_BROWSER=1: there a missing browser fails.
pytestmark = pytest.mark.skipif(
    (shutil.which("chromium") is None or shutil.which("chromedriver") is None)
    and os.environ.get("SERVEPLAN_REQUIRE_BROWSER") != "1",
    reason="the browser test needs chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra: pip install -e '.[dev]'")
from selenium.webdriver.common.by import By  # noqa: E402 (after the skip checks)
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = "requests=60&rate=4"
# page url path (after /) and query -> text that shows its results are drawn
PAGES = [
    ("simulate", SMALL, "Latency percentiles"),
    ("compare", SMALL, "Variants side by side"),
    ("memory", "model=llama-3.1-70b&tp=4&weight_dtype=fp8&kv_dtype=fp8", "Max concurrency by context"),
    ("hardware", "", "Roofline points"),
    ("validate", "", "Validate"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    # A private planner cache, so the plan below is computed rather than read from the user's.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"streamlit did not start:\n{out}")
            time.sleep(0.2)  # polling the health endpoint, not waiting for the page
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1440,1800", "--hide-scrollbars"):
        options.add_argument(flag)
    # The system driver: Selenium Manager would otherwise try to download one.
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")),
                              options=options)
    yield driver
    driver.quit()


# Waits end when the page is drawn; the limits only turn a hang into a failure, and are generous
# because CI runs this beside the rest of the suite on two busy cores.
PAGE_TIMEOUT_S = 600


def _wait_drawn(driver: webdriver.Chrome, text: str, timeout: float = PAGE_TIMEOUT_S) -> None:
    """Until `text` is on the page, Streamlit has stopped running and every chart has drawn."""
    wait = WebDriverWait(driver, timeout)
    wait.until(ec.presence_of_element_located((By.XPATH, f"//*[contains(normalize-space(.), {text!r})]")))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]'))
    wait.until(lambda d: all(c.find_elements(By.CSS_SELECTOR, "canvas, svg")
                             for c in d.find_elements(By.CSS_SELECTOR, '[data-testid="stVegaLiteChart"]')))
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("SERVEPLAN_SCREENSHOTS_DIR") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _screenshot(driver: webdriver.Chrome, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path))
    return path


def test_plan_in_the_browser(server: str, browser: webdriver.Chrome, screenshots: Path) -> None:
    browser.get(f"{server}/?hw=h100-sxm,l40s&requests=40&max_gpus=2&weight_dtypes=bf16,fp8&kv_dtypes=bf16"
                "&knobs=mbt2048%20seqs64")
    button = WebDriverWait(browser, PAGE_TIMEOUT_S).until(
        ec.element_to_be_clickable((By.XPATH, "//button[.//*[contains(text(), 'Run plan')]]")))
    # The sidebar form is taller than the window: bring the button to the middle before clicking it.
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    button.click()
    _wait_drawn(browser, "Recommended:")
    assert "Why not: rejected candidates" in browser.page_source
    assert _screenshot(browser, screenshots, "plan").stat().st_size > 20_000


@pytest.mark.parametrize(("page", "query", "marker"), PAGES, ids=[p[0] for p in PAGES])
def test_page_in_the_browser(server: str, browser: webdriver.Chrome, screenshots: Path, page: str, query: str,
                             marker: str) -> None:
    browser.get(f"{server}/{page}?{query}")
    _wait_drawn(browser, marker)
    assert _screenshot(browser, screenshots, page).stat().st_size > 20_000
